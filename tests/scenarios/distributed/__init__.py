"""Multi-process (gloo) scaffolding: rank scripts launched with `torch.distributed.run`, and their launcher."""
