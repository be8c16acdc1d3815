import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every zoo run on one torch thread, as ORT and OpenVINO run there (lifecycle.py). `make test`
    runs this folder in two pytest-xdist workers, one per core: a second torch thread per worker
    would only contend with the other worker."""
    torch.set_num_threads(1)
    yield
