"""Running a run on a cluster engine users already have: Ray (`heterorl train --launcher ray`), Slurm and
Kubernetes (`heterorl deploy slurm|k8s CONFIG` renders their files). The processes are the same as on one machine
(the learner's ranks under torch.distributed, rollout workers over ZeroMQ); the engine places them, gives them
resources and brings back what dies. docs/DEPLOY.md. The config's `cluster` section is `heterorl.config.cluster`."""
