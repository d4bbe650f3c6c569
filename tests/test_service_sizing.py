"""How the server sizes the engine from the GPU's free memory (no GPU needed: the query is faked)."""
from types import SimpleNamespace

import torch

from app import service


def fake_model(device="cuda"):
    t = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, head_dim=128)   # the 0.6B talker
    return SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16,
                           config=SimpleNamespace(talker=SimpleNamespace(transformer=t)))


def test_slots_and_cache_budget_follow_free_memory(monkeypatch):
    per_slot = service.SLOT_POSITIONS * 28 * 2 * 8 * 128 * 2 * 1.5          # ~344 MB
    for free, slots in ((140e9, 256), (21e9, int(21e9 * 0.7 // per_slot)), (1e8, 1)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (int(free), int(2 * free)))
        batch, budget = service.size_engine(fake_model(), None)
        assert (batch, budget) == (slots, int(free * service.KV_CACHE_SHARE))
    assert service.size_engine(fake_model(), 8)[0] == 8                    # --max-batch wins
    assert service.size_engine(fake_model("cpu"), None) == (16, None)
