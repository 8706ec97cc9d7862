"""Starting and stopping ranks: spawn (`--nproc`), forked CPU ranks, a rank's side of torchrun /
SLURM / the deepspeed launcher, preemption signals, the hang watchdog and the host allocator."""
