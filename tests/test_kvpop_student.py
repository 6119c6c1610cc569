"KVpop's distillation student: its training attention is the KVpop mask policy, and it captures what its loss needs."
import pytest
import torch

from sparsekv.hf import patch
from sparsekv.kvpop.cache import KVpopMaskPolicy, random_scorers
from sparsekv.kvpop.student import KVpopMLP, KVpopMLSTM, KVpopStudent
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


# --- a trained.pt of another method or scorer type is refused, naming both -------------

def _saved(tmp_path, method, model, spec=True):
    "A trained.pt as the distill CLI writes it for `method` (with or without its description)."
    from sparsekv.distill import student_spec
    st = method.student(model)
    ckpt = dict(student=st.state_dict())
    if spec: ckpt["spec"] = dict(method=method.name, student=student_spec(st))
    torch.save(ckpt, tmp_path / "trained.pt")
    return tmp_path / "trained.pt"


@pytest.mark.parametrize("saved,loaded,msg", [
    ("kvpop_mlp", "kvpop_mlstm", r"holds a kvpop_mlp student \(KVpopStudent: .*MLPScorer\), not one of kvpop_mlstm "
                                 r"\(KVpopStudent: .*MLSTMScorer\)"),
    ("kvpop_mlstm", "kvpop_mlp", r"holds a kvpop_mlstm student .*MLSTMScorer.*not one of kvpop_mlp .*MLPScorer"),
    ("kvpop_mlp", "streaming_llm_plus", r"not one of streaming_llm_plus \(SinkWindowStudent: no submodules\)"),
    ("kvpop_mlp", "dms", r"holds a kvpop_mlp student \(KVpopStudent: .*\), not one of dms \(DMSStudent: "),
])
def test_checkpoint_of_another_method_names_both(tmp_path, saved, loaded, msg):
    from sparsekv import methods
    model, _ = load_model("tiny-llama")
    path = _saved(tmp_path, methods.make(saved, budget=9, sink=2, window=4), model)
    with pytest.raises(ValueError, match=msg):
        methods.make(loaded, budget=9, sink=2, window=4, checkpoint=path).cache(model)


def test_checkpoint_without_description_is_checked_by_its_entries(tmp_path):
    "A student state saved by hand (no spec): another scorer type or another model is still refused clearly."
    model, _ = load_model("tiny-llama")
    path = _saved(tmp_path, KVpopMLSTM(9, 2, 4), model, spec=False)
    with pytest.raises(ValueError, match=r"holds another student than kvpop_mlp's \(KVpopStudent: .*MLPScorer\)"):
        KVpopMLP(9, 2, 4, checkpoint=path).cache(model)
    KVpopMLSTM(9, 2, 4, checkpoint=path).cache(model)  # its own method loads it
    other, _ = load_model("tiny-llama", num_kv_heads=1)
    with pytest.raises(ValueError, match="trained on another model: the kvpop_mlstm student's shapes differ"):
        KVpopMLSTM(9, 2, 4, checkpoint=path).cache(other)
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match="holds no 'student' state"): KVpopMLSTM(9, 2, 4, checkpoint=path).cache(model)


def test_checkpoint_of_the_same_method_loads(tmp_path):
    model, _ = load_model("tiny-llama")
    method = KVpopMLP(9, 2, 4)
    st = method.student(model)
    for p in st.parameters(): p.data.add_(0.5)
    from sparsekv.distill import student_spec
    torch.save(dict(student=st.state_dict(), spec=dict(method="kvpop_mlp", student=student_spec(st))),
               tmp_path / "trained.pt")
    loaded = KVpopMLP(9, 2, 4, checkpoint=tmp_path / "trained.pt").trained_student(model)
    for a, b in zip(st.state_dict().values(), loaded.state_dict().values()): assert torch.equal(a, b)
