"""POISE for TRL: value baselines predicted from the policy's own internal states."""

__version__ = "0.1.0"
