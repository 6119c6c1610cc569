"KVpop's distillation student: its training attention is the KVpop mask policy, and it captures what its loss needs."
import pytest
import torch

from sparsekv.hf import patch
from sparsekv.kvpop.cache import KVpopMaskPolicy, random_scorers
from sparsekv.kvpop.student import KVpopStudent
from sparsekv.models import load_model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_student_attention_is_the_kvpop_mask_policy(name):
    "In eval and train mode the student's logits equal those under KVpopMaskPolicy (dense mask, independent path)."
    model, _ = load_model(name)
    sc = random_scorers(model, seed=3)
    student = KVpopStudent(sc, sink=2, window=3, k=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), patch(model, KVpopMaskPolicy(sc, 2, 3, 4)): ref = model(input_ids=ids).logits
    student.eval()
    with torch.no_grad(), patch(model, student.policy()): got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    student.train()
    with patch(model, student.policy()): got = model(input_ids=ids).logits
    torch.testing.assert_close(got.detach(), ref, atol=1e-5, rtol=1e-5)
    assert len(student.captured) == model.config.num_hidden_layers
    loss, metrics = student.method_loss(0)
    assert loss.ndim == 0 and loss.item() > 0 and 0 <= metrics["retention_recall"] <= 1 and student.captured == []
