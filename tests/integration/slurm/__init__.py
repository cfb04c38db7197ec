"""The tests on a real Slurm cluster: one package, so that the cluster (`tests.slurm_cluster`, package-scoped) is
removed as soon as its last test ends, not at the end of the session."""
