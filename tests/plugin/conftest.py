import pytest
import torch

from afd_devcluster.checkpoints import MODEL_TYPES, write_moe_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """One tiny random checkpoint per supported model type (plus V2 group-limited)."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {mt: write_moe_checkpoint(root / mt, mt, seed=i) for i, mt in enumerate(MODEL_TYPES)}
    paths["deepseek_v2_group_limited"] = write_moe_checkpoint(
        root / "deepseek_v2_group_limited", "deepseek_v2", seed=7, topk_method="group_limited_greedy", n_group=4,
        topk_group=2)
    return paths


@pytest.fixture(autouse=True)
def _single_thread():
    torch.set_num_threads(1)
