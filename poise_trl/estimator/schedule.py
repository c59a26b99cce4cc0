"""When each domain's probe is fitted and trusted: the schedules `BufferSpec.schedule` names (`SCHEDULES`).

"domain" (poise-trl's) lets each domain learn on its own: its probe is refitted after every step whose batch held
it, once its buffer holds two rows, and trusted once the domain has `warmup_steps` observed steps; a domain first seen
late has a bootstrap of its own. "global" is the POISE authors' reference's (verl-project/verl-recipe,
`poise/probe.py`, `ProbeBank.commit`): one bootstrap of `warmup_steps` training steps for every domain, during which no
probe is fitted; at its last step every domain's probe is fitted at once and each domain's observed-step count is set
to the training step; after it, a domain's probe is refitted after each step whose batch held it once its count
reaches `domain_warmup_steps`. The domains named in `domain_sizes` must all have rows by then, and with such a list no
other domain is accepted (the reference's buffers are its configured domains).

A schedule decides, and changes nothing: `plan` returns the learners with the step counts it sets and the names of
those to refit; the estimator fits them while it builds its next state (estimator.py). Step counts are the learners'
own (`OnlineLearner.steps`), saved with them, so no schedule adds learned state.
"""

from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

from .learner import OnlineLearner


class BufferSettings(Protocol):
    """The buffer settings a schedule reads (`specs.BufferSpec` has them; named here so specs may list `SCHEDULES`)."""

    warmup_steps: int
    domain_warmup_steps: int
    domain_sizes: Mapping[str, int]


Plan = tuple[dict[str, OnlineLearner], list[str]]
"""The learners with the step counts a schedule sets, and the domains whose probe it refits now."""


class Schedule(Protocol):
    """When the domains' probes are fitted and trusted (module docstring)."""

    def learner_warmup(self, buffer: BufferSettings) -> int:
        """Observed steps a domain's learner waits before its fitted head is trusted (`OnlineLearner.trusted`)."""

    def accepts(self, domains: Iterable[str], buffer: BufferSettings) -> None:
        """Refuse a batch holding a domain the schedule cannot serve."""

    def plan(
        self,
        probes: Mapping[str, OnlineLearner],
        steps: int,
        present: Collection[str],
        layer_index: int,
        buffer: BufferSettings,
    ) -> Plan:
        """After training step `steps` (counted from 1), whose batch held the domains `present` and was added to
        `probes`: the learners and the domains to refit on feature slice `layer_index`."""

    def may_fit(self, online: OnlineLearner, steps: int, buffer: BufferSettings) -> bool:
        """Whether a learner may hold a fitted probe after `steps` steps (a refit from its buffer, `refit`)."""


def _moved(online: OnlineLearner, layer_index: int) -> bool:
    """A fitted probe on another feature slice than the one in use (the layer choice moved)."""
    return online.probe.is_fitted and online.layer_index != layer_index


class DomainTrust:
    """Each domain on its own (module docstring)."""

    def learner_warmup(self, buffer: BufferSettings) -> int:
        return buffer.warmup_steps

    def accepts(self, domains: Iterable[str], buffer: BufferSettings) -> None:
        """Any domain: one not in `domain_sizes` has a buffer of `size` rows."""

    def plan(
        self,
        probes: Mapping[str, OnlineLearner],
        steps: int,
        present: Collection[str],
        layer_index: int,
        buffer: BufferSettings,
    ) -> Plan:
        refit = [
            name
            for name, online in probes.items()
            if online.can_fit and (name in present or online.layer_index != layer_index)
        ]
        return dict(probes), refit

    def may_fit(self, online: OnlineLearner, steps: int, buffer: BufferSettings) -> bool:
        return True


class GlobalBootstrap:
    """One bootstrap for every domain, then each domain's probe refitted once it has enough steps (module
    docstring)."""

    def learner_warmup(self, buffer: BufferSettings) -> int:
        return 0  # a probe is fitted only once the bootstrap is over (or loaded by a warm start): trusted when fitted

    def accepts(self, domains: Iterable[str], buffer: BufferSettings) -> None:
        configured = list(buffer.domain_sizes)
        unknown = sorted(set(domains) - set(configured)) if configured else []
        if unknown:
            raise ValueError(
                f"The batch holds the domains {unknown}, which domain_sizes (probe_domain_buffer_sizes) does not "
                f"name: with schedule 'global' (probe_schedule) it lists every domain, {configured}, each fitted at "
                "the end of the bootstrap. Add them to it (with their buffer size), or route them to one it names "
                "(probe_domain_routing)."
            )

    def plan(
        self,
        probes: Mapping[str, OnlineLearner],
        steps: int,
        present: Collection[str],
        layer_index: int,
        buffer: BufferSettings,
    ) -> Plan:
        bootstrap = buffer.warmup_steps
        if steps == bootstrap:  # every domain's probe at once, each domain's count set to the training step
            empty = [name for name in buffer.domain_sizes if name not in probes or len(probes[name].buffer) < 2]
            if empty:
                raise ValueError(
                    f"The bootstrap's {bootstrap} steps gave fewer than two rows to the domains {empty} of "
                    "domain_sizes (probe_domain_buffer_sizes), whose probes schedule 'global' (probe_schedule) fits "
                    "now: drop them from it, or train on data that holds them."
                )
            counted = {name: online.replace(steps=steps) for name, online in probes.items()}
            return counted, [name for name, online in counted.items() if online.can_fit]
        refit = [
            name
            for name, online in probes.items()
            if online.can_fit
            and (steps > bootstrap or online.warm_started)
            and ((name in present and online.steps >= buffer.domain_warmup_steps) or _moved(online, layer_index))
        ]
        return dict(probes), refit

    def may_fit(self, online: OnlineLearner, steps: int, buffer: BufferSettings) -> bool:
        return steps >= buffer.warmup_steps or online.warm_started


SCHEDULES: dict[str, Schedule] = {"domain": DomainTrust(), "global": GlobalBootstrap()}
"""`probe_schedule` -> when each domain's probe is fitted and trusted. A new schedule is one entry with these four
methods."""
