"""OVAL page basis (`sparsekv.oval.basis`) against the direct d x d eigenproblem, key PCA, the exact page LSE and loops,
on random and degenerate pages."""
import math

import pytest
import torch
from torch.testing import assert_close

from sparsekv.oval.basis import (
    centre_page,
    hybrid_metric,
    output_metric,
    page_basis,
    page_basis_reference,
    page_lse_exact,
    page_risks,
    page_score,
    subspace_distance,
)

ETAS = [0.0, 0.25, 0.5, 0.75, 1.0]
F64 = torch.float64


def make_pages(lead=(4, 3), m=32, d=64, dv=None, seed=0, dtype=F64, spread=1.0):
    """Random pages: keys with a decaying spectrum (10**spread from first to last channel) and a shared offset, values,
    one G per KV head."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    spectrum = torch.logspace(0, -spread, d, dtype=F64)
    K = torch.randn(*lead, m, d, generator=g, dtype=F64) * spectrum + torch.randn(d, generator=g, dtype=F64)
    V = torch.randn(*lead, m, dv, generator=g, dtype=F64)
    A = torch.randn(lead[-1] if lead else 1, dv, dv, generator=g, dtype=F64)
    G = A.mT @ A / dv
    if not lead: G = G[0]
    return K.to(dtype), V.to(dtype), G.to(dtype)


def eye_like(B):
    return torch.eye(B.shape[-1], dtype=B.dtype).expand(*B.shape[:-2], -1, -1)


def key_pca(K, r):
    "Top r right singular vectors of the centred keys (page-local key PCA), by SVD."
    _, X = centre_page(K.double())
    return torch.linalg.svd(X, full_matrices=False).Vh[..., :r, :].mT


@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("shape", [dict(m=32, d=64), dict(m=16, d=24, dv=8), dict(m=12, d=8), dict(m=9, d=40, dv=40)])
def test_gram_route_equals_direct_eigenproblem(eta, shape):
    K, V, G = make_pages(**shape, seed=hash((eta, tuple(shape.values()))) % 1000)
    mu, B, R = page_basis(K, V, G, rank=6, eta=eta)
    mu_ref, B_ref, R_ref = page_basis_reference(K, V, G, rank=6, eta=eta)
    assert B.shape == B_ref.shape and R.shape == R_ref.shape
    assert subspace_distance(B, B_ref).max() < 1e-8            # the goal is 1e-4
    assert_close(mu, mu_ref)
    assert_close(B.mT @ B, eye_like(B))
    _, X = centre_page(K)
    assert_close(R, X @ B)


@pytest.mark.parametrize("eta", ETAS)
def test_float32_and_bf16(eta):
    K, V, G = make_pages(seed=1)
    B_ref = page_basis_reference(K, V, G, rank=8, eta=eta)[1]
    mu32, B32, R32 = page_basis(K.float(), V.float(), G.float(), rank=8, eta=eta)
    assert {mu32.dtype, B32.dtype, R32.dtype} == {torch.float32}
    assert_close(B32.mT @ B32, eye_like(B32), atol=1e-5, rtol=0)
    assert subspace_distance(B32.double(), B_ref).max() < 1e-3
    out = page_basis(K.bfloat16(), V.bfloat16(), G.float(), rank=8, eta=eta)
    assert all(t.dtype == torch.bfloat16 for t in out)
    assert all(torch.isfinite(t.float()).all() for t in out)
    Kb, Vb = K.bfloat16().double(), V.bfloat16().double()       # the same pages, as the cache holds them
    assert subspace_distance(out[1].double(), page_basis_reference(Kb, Vb, G, rank=8, eta=eta)[1]).max() < 0.05


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_eta0_is_key_pca(dtype):
    K, V, G = make_pages(seed=2, dtype=dtype)
    B = page_basis(K, V, G, rank=8, eta=0.0)[1]
    tol = 1e-10 if dtype == F64 else 1e-3
    assert subspace_distance(B.double(), key_pca(K, 8)).max() < tol
    # G and V play no role at eta = 0
    assert subspace_distance(B, page_basis(K, torch.randn_like(V), None, rank=8, eta=0.0)[1]).max() < tol


@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("spread", [0.0, 3.0])
def test_rank_m_minus_1_is_exact(eta, dtype, tol, spread):
    """At rank m-1 the basis contains the row space of X, so the page score is the exact page LSE (also for
    ill-conditioned keys)."""
    K, V, G = make_pages(seed=3, dtype=dtype, spread=spread)
    mu, B, R = page_basis(K, V, G, rank=31, eta=eta)
    assert B.shape[-1] == 31
    q = torch.randn(4, 3, 64, dtype=F64)
    assert_close(page_score(q.to(dtype), mu, B, R).double(), page_lse_exact(q, K.double()), atol=tol, rtol=0)


@pytest.mark.parametrize("m,d,rank,want", [(32, 64, 8, 8), (5, 64, 8, 4), (9, 64, 8, 8), (32, 3, 8, 3), (2, 5, 8, 1),
                                           (1, 4, 8, 0), (32, 64, 40, 31)])
def test_rank_cap(m, d, rank, want):
    K, V, G = make_pages(lead=(2,), m=m, d=d, seed=4)
    mu, B, R = page_basis(K, V, G, rank=rank)
    assert B.shape == (2, d, want) and R.shape == (2, m, want) and mu.shape == (2, d)
    assert page_basis_reference(K, V, G, rank=rank)[1].shape == (2, d, want)
    if want == min(m - 1, d):                                    # the basis covers the row space of X: exact
        q = torch.randn(2, d, dtype=F64)
        assert_close(page_score(q, mu, B, R), page_lse_exact(q, K), atol=1e-10, rtol=0)


def test_batching_matches_loop():
    K, V, G = make_pages(lead=(5, 3), m=16, d=32, seed=5)        # [pages, Hkv, m, d], G [Hkv, d, d]
    mu, B, R = page_basis(K, V, G, rank=4, eta=0.5)
    for p in range(5):
        for h in range(3):
            mu1, B1, R1 = page_basis(K[p, h], V[p, h], G[h], rank=4, eta=0.5)
            assert_close(mu[p, h], mu1)
            assert subspace_distance(B[p, h], B1) < 1e-10
            assert_close(R[p, h] @ B[p, h].mT, R1 @ B1.mT)      # X P_B, independent of the basis' signs
    # heads-first layout with G broadcast over pages
    Bt = page_basis(K.transpose(0, 1), V.transpose(0, 1), G[:, None], rank=4, eta=0.5)[1]
    assert subspace_distance(Bt.transpose(0, 1), B).max() < 1e-10


def test_invariances():
    "The basis depends on the centred page only, and not on the scales of K, V or G (trace normalization)."
    K, V, G = make_pages(seed=6)
    shift = torch.randn(64, dtype=F64)
    for eta in ETAS:
        B = page_basis(K, V, G, rank=8, eta=eta)[1]
        for K2, V2, G2 in [(K + shift, V - 3.0, G), (7.0 * K, 0.01 * V, 50.0 * G), (1e-3 * K, 1e3 * V, G)]:
            assert subspace_distance(page_basis(K2, V2, G2, rank=8, eta=eta)[1], B).max() < 1e-8
    with_identity = page_basis(K, V, torch.eye(64, dtype=F64), rank=8)[1]
    assert subspace_distance(page_basis(K, V, None, rank=8)[1], with_identity).max() < 1e-10


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["m=1", "identical keys", "zero values", "zero page",
                                  "two tokens, one repeated value"])
def test_degenerate_pages(dtype, case):
    K, V, G = make_pages(lead=(2, 3), m=8, d=16, seed=7)
    if case == "m=1": K, V = K[..., :1, :], V[..., :1, :]
    if case == "identical keys": K = K[..., :1, :].expand_as(K).clone()
    if case == "zero values": V = torch.zeros_like(V)
    if case == "zero page": K, V = torch.zeros_like(K), torch.zeros_like(V)
    if case == "two tokens, one repeated value": K, V = K[..., :2, :], V[..., :1, :].expand(2, 3, 2, 16).clone()
    K, V = K.to(dtype), V.to(dtype)
    q = torch.randn(2, 3, 16, dtype=F64)
    atol = {F64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for eta in ETAS:
        mu, B, R = page_basis(K, V, G.float(), rank=8, eta=eta)
        assert all(t.dtype == dtype and torch.isfinite(t.float()).all() for t in (mu, B, R))
        Bw = B.double()
        assert_close(Bw.mT @ Bw, eye_like(Bw), atol=atol, rtol=0)
        if dtype == F64:                                          # every degenerate page has rank X <= 7: exact
            assert_close(page_score(q, mu, B, R), page_lse_exact(q, K), atol=1e-10, rtol=0)


def test_thread_count_is_restored():
    """page_basis runs its CPU eigensolvers on one thread (MKL's threaded eigh is slow on tiny matrices) and restores
    the setting."""
    K, V, G = make_pages(lead=(2, 3), m=8, d=16, seed=15)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        page_basis(K, V, G[0], rank=4)
        page_basis_reference(K, V, G[0], rank=4)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_zero_values_at_eta1_fall_back_to_key_pca():
    K, V, G = make_pages(seed=8)
    B = page_basis(K, torch.zeros_like(V), G, rank=8, eta=1.0)[1]
    assert subspace_distance(B, key_pca(K, 8)).max() < 1e-10


def test_low_rank_output_coupling_is_completed_by_key_energy():
    "eta = 1 with values of rank 2: C has rank 2, the other r - 2 columns are key PCA of what is left (App. A.4)."
    K, V, G = make_pages(lead=(3,), seed=9)
    V = torch.randn(3, 32, 2, dtype=F64) @ torch.randn(3, 2, 64, dtype=F64)
    B = page_basis(K, V, G, rank=8, eta=1.0)[1]
    B_out = page_basis_reference(K, V, G, rank=2, eta=1.0)[1]    # the two output directions
    assert subspace_distance(B[..., :2], B_out).max() < 1e-8
    _, X = centre_page(K)
    X_perp = X - X @ B_out @ B_out.mT
    D = torch.linalg.svd(X_perp, full_matrices=False).Vh[..., :6, :].mT
    assert subspace_distance(B[..., 2:], D).max() < 1e-8


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_basis_minimizes_hybrid_risk(eta):
    "Lemma 3.2 via page_risks: no random orthonormal basis has a lower R_eta than the OVAL basis."
    K, V, G = make_pages(lead=(), m=12, d=10, seed=10)
    B = page_basis(K, V, G, rank=3, eta=eta)[1]
    M = hybrid_metric(K, V, G, eta)
    _, X = centre_page(K)
    _, Y = centre_page(V)
    c_key, c_out = 1 / (X.T @ X).trace(), 1 / (X.T @ Y @ G @ Y.T @ X).trace()

    def r_eta(Bs):
        rk, ro = page_risks(K, V, Bs, G)
        return (1 - eta) * c_key * rk + eta * c_out * 12 ** 2 * ro

    rand = torch.linalg.qr(torch.randn(4000, 10, 3, dtype=F64)).Q
    assert r_eta(rand).min() >= r_eta(B) - 1e-12
    J = torch.eye(10, dtype=F64) - B @ B.T
    assert_close(r_eta(B), torch.trace(J @ M @ J) / 10)


def test_page_risks_against_loops():
    K, V, G = make_pages(lead=(), m=7, d=5, dv=3, seed=11)
    B = torch.linalg.qr(torch.randn(5, 2, dtype=F64)).Q
    rk, ro = page_risks(K, V, B, G)
    _, X = centre_page(K)
    _, Y = centre_page(V)
    J = torch.eye(5, dtype=F64) - B @ B.T
    key = sum(float(J[:, a] @ X.T @ X @ J[:, a]) for a in range(5)) / 5
    out = sum(float(J[:, a] @ X.T @ Y @ G @ Y.T @ X @ J[:, a]) for a in range(5)) / (49 * 5)
    assert math.isclose(float(rk), key, rel_tol=1e-12) and math.isclose(float(ro), out, rel_tol=1e-12)


def test_output_metric_against_loop():
    g = torch.Generator().manual_seed(12)
    for Hq, Hkv, hd in [(9, 3, 8), (4, 4, 6), (8, 1, 4)]:
        W = torch.randn(30, Hq * hd, generator=g, dtype=F64)
        G = output_metric(W, Hq, Hkv, hd)
        assert G.shape == (Hkv, hd, hd)
        for h in range(Hkv):
            want = sum(W[:, j * hd:(j + 1) * hd].T @ W[:, j * hd:(j + 1) * hd]
                       for j in range(Hq) if j // (Hq // Hkv) == h)
            assert_close(G[h], want)
        assert output_metric(W.bfloat16(), Hq, Hkv, hd).dtype == torch.float32
        assert torch.linalg.eigvalsh(G).min() > -1e-10


def test_output_metric_from_a_llama_layer():
    "The group metric from a real Llama attention module's o_proj, with the model's head bookkeeping."
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention
    cfg = LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    attn = LlamaAttention(cfg, layer_idx=0)
    W = attn.o_proj.weight.detach()
    G = output_metric(W, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    # delta o on the query heads of KV head 1 only: ||o_proj(delta)||^2 = sum_g ||delta_g||^2 in W_g^T W_g,
    # equal deltas -> G_1
    delta = torch.randn(8)
    full = torch.zeros(6 * 8)
    for j in (3, 4, 5):                                           # query heads h*G+g of KV head h = 1
        full[j * 8:(j + 1) * 8] = delta
    y = attn.o_proj(full)
    cross = sum(delta @ W[:, i * 8:(i + 1) * 8].T @ W[:, j * 8:(j + 1) * 8] @ delta
                for i in (3, 4, 5) for j in (3, 4, 5) if i != j)
    assert_close(y @ y, delta @ G[1] @ delta + cross, rtol=1e-4, atol=1e-4)


def test_page_score_against_loop_and_bound():
    K, V, _ = make_pages(lead=(3, 5), m=16, d=32, seed=13)         # [Hkv, P, m, d]
    A = torch.randn(3, 32, 32, dtype=F64)
    G = A.mT @ A / 32                                             # one metric per KV head
    mu, B, R = page_basis(K, V, G[:, None], rank=4, eta=0.5)   # G per KV head, broadcast over pages
    q = torch.randn(3, 2, 1, 32, dtype=F64)                       # [Hkv, G, 1, d]
    got = page_score(q, mu[:, None], B[:, None], R[:, None])
    assert got.shape == (3, 2, 5)
    for h in range(3):
        for g in range(2):
            for p in range(5):
                qv = q[h, g, 0]
                logits = [(float(R[h, p, t] @ (B[h, p].T @ qv)) + float(mu[h, p] @ qv)) / math.sqrt(32)
                          for t in range(16)]
                mx = max(logits)
                lse = mx + math.log(sum(math.exp(x - mx) for x in logits))
                assert math.isclose(float(got[h, g, p]), lse, rel_tol=1e-12, abs_tol=1e-12)
    exact = page_lse_exact(q, K[:, None])
    loop = torch.tensor([[[float(torch.logsumexp(K[h, p] @ q[h, g, 0] / math.sqrt(32), 0)) for p in range(5)]
                          for g in range(2)] for h in range(3)], dtype=F64)
    assert_close(exact, loop)
    _, X = centre_page(K)
    XJ = X - X @ B @ B.mT                                          # X (I - P_B)  [Hkv, P, m, d]
    e = XJ[:, None] @ q[..., None] / math.sqrt(32)                  # e_B(q)  [Hkv, G, P, m, 1]
    assert ((got - exact).abs() <= e.abs().amax((-2, -1)) + 1e-12).all()
    # a custom scale: exact at rank m - 1, and the mean term scales with it
    full = page_basis(K, V, G[:, None], rank=15)
    scaled = page_lse_exact(q, K[:, None], scale=0.3)
    assert_close(page_score(q, *(t[:, None] for t in full), scale=0.3), scaled, atol=1e-10, rtol=0)
    assert_close(scaled, torch.logsumexp(0.3 * (K[:, None] @ q[..., None]).squeeze(-1), -1))
    assert page_score(q.float(), mu[:, None], B[:, None], R[:, None]).dtype == F64
    assert page_score(q.float(), mu[:, None].float(), B[:, None].float(), R[:, None].float()).dtype == torch.float32


def test_bad_input():
    K, V, G = make_pages(lead=(2,), m=8, d=16, seed=14)
    G = G[0]
    with pytest.raises(TypeError, match="K must be a torch.Tensor"): page_basis(K.numpy(), V, G)
    with pytest.raises(TypeError, match="floating-point"): page_basis(K, V.long(), G)
    with pytest.raises(ValueError, match="K must be"): page_basis(K[0, 0], V[0, 0], G)
    with pytest.raises(ValueError, match="V must be"): page_basis(K, V[:, :7], G)
    with pytest.raises(ValueError, match="G must be"): page_basis(K, V, G[:4, :4])
    with pytest.raises(ValueError, match="must broadcast"): page_basis(K, V, G.expand(3, 16, 16))
    with pytest.raises(ValueError, match="rank must be"): page_basis(K, V, G, rank=0)
    with pytest.raises(ValueError, match="rank must be"): page_basis(K, V, G, rank=2.0)
    with pytest.raises(ValueError, match="eta must be"): page_basis(K, V, G, eta=-0.1)
    with pytest.raises(ValueError, match="eta must be"): page_basis(K, V, G, eta=True)
    with pytest.raises(ValueError, match="eta must be"): hybrid_metric(K, V, G, eta=2)
    with pytest.raises(ValueError, match="B must be"): page_risks(K, V, torch.zeros(2, 8, 3, dtype=F64), G)
    with pytest.raises(ValueError, match="need q"): page_score(torch.zeros(2, 15), *page_basis(K, V, G, rank=2))
    with pytest.raises(ValueError, match="scale must be"):
        page_score(torch.zeros(2, 16), *page_basis(K, V, G, rank=2), scale=float("nan"))
    with pytest.raises(ValueError, match="need q"): page_lse_exact(torch.zeros(2, 15), K)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"): output_metric(torch.zeros(4, 30), 6, 4, 5)
    with pytest.raises(ValueError, match="o_proj_weight must be"): output_metric(torch.zeros(4, 30), 6, 3, 4)
    with pytest.raises(ValueError, match="num_heads must be"): output_metric(torch.zeros(4, 30), 0, 3, 5)
    with pytest.raises(ValueError, match="B1 and B2"): subspace_distance(torch.zeros(4, 2), torch.zeros(4, 3))


@pytest.mark.parametrize("name", ["K", "V", "G"])
def test_page_basis_refuses_non_finite(name):
    "A NaN or inf would fail inside eigh ('ill-conditioned'): refused up front, naming the tensor."
    g = torch.Generator().manual_seed(0)
    args = dict(K=torch.randn(3, 8, 6, generator=g), V=torch.randn(3, 8, 6, generator=g), G=torch.eye(6))
    args[name] = args[name].index_fill(-1, torch.tensor([1]), math.nan if name != "V" else math.inf)
    for fn in (page_basis, page_basis_reference):
        with pytest.raises(ValueError, match=f"{name} contains NaN or inf"): fn(**args, rank=2)


@pytest.mark.parametrize("name", ["K", "V", "G"])
def test_page_basis_refuses_meta_tensors(name):
    "A meta tensor (a shape, no values) failed deep inside on Tensor.item(); refused up front, naming it."
    args = dict(K=torch.randn(3, 8, 6), V=torch.randn(3, 8, 6), G=torch.eye(6))
    args = {n: x.to("meta") if n == name or (name == "V" and n == "K") else x for n, x in args.items()}
    want = "K" if name == "V" else name  # V on meta with K on cpu is a device mismatch; both on meta: K named first
    for fn in (page_basis, page_basis_reference):
        with pytest.raises(ValueError, match=f"{want} is a meta tensor .* needs a tensor with data"): fn(**args, rank=2)
