import pytest

from tests.slurm_cluster import running_cluster


@pytest.fixture(scope="package")
def slurm_cluster():
    """slurmctld plus eight slurmd, each node in its own network namespace; removed after this package's last test,
    also when a test failed."""
    yield from running_cluster()
