"""The launch room: starting a run's ranks here or joining torchrun's or srun's
(launcher, rank), naming the first cause of a failure and keeping it (failure), starting
Horovod inside each worker (horovod) and emulated networks of namespaces (netem).
See harness/launch/README.md."""
