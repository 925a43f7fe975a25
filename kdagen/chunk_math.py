"""The formulas of one 16-token (or any n-token) chunk of the KDA forward and of its backward (kda-math
§2.3-§2.5, §8), in plain torch.

Every function is generic in the dtype and in the leading dim: inputs are ``[Bt, n, *]`` per chunk, where Bt
is any batch (the value heads of one chunk in the references, tiles times value heads in
:mod:`kdagen.backward_local`), and states ``[Bt, K, V]``. Nothing here loops over chunks or sequences.
"""

from __future__ import annotations

import torch

__all__ = ["backward_from_dA", "chunk_parts", "chunk_stage_backward", "chunk_step"]

Tensor = torch.Tensor

# torch.bmm's out_dtype (CUDA only): bf16 operands give their fp32 accumulators without rounding them to bf16.
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def _state_mm(a: Tensor, b: Tensor, mm_dtype: torch.dtype | None, out_dtype: torch.dtype) -> Tensor:
    """The batched product ``a @ b`` ([Bt, m, k] x [Bt, k, n]) of a product with a [Bt, K, V] state or its
    gradient. With ``mm_dtype`` both operands are cast to it (a no-op for a state cast already) and torch's
    matmul accumulates in fp32, on tensor cores on the GPU; the result is ``out_dtype``. On CUDA the
    accumulators come back in fp32 (``out_dtype`` of torch.bmm), elsewhere rounded to ``mm_dtype`` first."""
    if mm_dtype is None:
        return a @ b
    a, b = a.to(mm_dtype), b.to(mm_dtype)
    if a.is_cuda and _BMM_OUT_DTYPE:
        return torch.bmm(a, b, out_dtype=torch.float32).to(out_dtype)
    return (a @ b).to(out_dtype)


def _row_dot(S: Tensor, dS: Tensor, mm_dtype: torch.dtype | None, out_dtype: torch.dtype) -> Tensor:
    """sum_v S[:, k, v] dS[:, k, v] ([Bt, K, V] each -> [Bt, K]) as Bt * K products [1, V] x [V, 1], which
    build no [Bt, K, V] tensor as ``(S * dS).sum(-1)`` does, as long as both are row-major in (k, v) with the
    batch outermost; an operand in any other layout is copied once by the reshape."""
    Bt, K, V = S.shape
    return _state_mm(S.reshape(Bt * K, 1, V), dS.reshape(Bt * K, V, 1), mm_dtype, out_dtype).view(Bt, K)


def chunk_parts(
    qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor, *, anchored: bool = False,
    mm_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """The intermediates of one chunk of n <= C tokens, all value heads (inputs [HV,n,*], the state S [HV,K,V]
    entering it): what the forward computes and the backward recomputes (stage 1 of kda-math §8).

    The pairwise form (the default) builds the decays exp(G_r - G_s) as [HV,n,n,K] tensors (``E``, ``Ek``)
    and holds for any g <= 0, hard resets included. The ``anchored`` form splits each decay at the middle row
    a = n // 2, exp(G_r - G_s) = exp(G_r - G_a) exp(G_a - G_s), so Aqk and Akk are [n,K] x [K,n] matmuls and
    no [n,n,K] tensor exists; it returns ``eR`` = exp(G - G_a), ``eC`` = exp(G_a - G), ``Lr`` = [Q; K] * eR
    ([HV,2n,K], the row sides of Aqk and Akk) and ``Kc`` = K * eC (their column side) instead. Its factors
    stay finite only while every |G_r - G_a| is well inside the dtype's range: with the safe gate (g >= -5)
    and n <= 16 they are at most 5 * 8 = 40 nats (e^40 ~ 2.4e17, fp32 reaches 3.4e38), whereas a hard reset
    (g = -1000) overflows them.

    ``mm_dtype`` computes the one product with the state, W S, from operands in that dtype (`_state_mm`);
    S may arrive in it already. Everything else is computed in ``qc``'s dtype."""
    n = qc.shape[1]
    dev, dt = qc.device, qc.dtype
    zero = torch.zeros((), dtype=dt, device=dev)
    G = gc.cumsum(dim=1)  # chunk-local inclusive cumsum (natural log), [HV,n,K]
    rows = torch.arange(n, device=dev)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    parts: dict[str, Tensor] = {"incl": incl, "strict": strict}
    if anchored:
        Ga = G[:, n // 2:n // 2 + 1, :]
        eR = (G - Ga).exp()
        eC = (Ga - G).exp()
        Lr = torch.cat((qc * eR, kc * eR), dim=1)  # [HV,2n,K]
        Kc = kc * eC
        # Above the diagonal the products carry exp(G_r - G_s) >= 1 (e^80 at most under the safe gate): a
        # select, not a multiplied mask, drops them, so not even an inf there could reach a result.
        AqkAkk = torch.where(incl, (Lr @ Kc.transpose(1, 2)).view(qc.shape[0], 2, n, n), zero)
        Aqk, Akk = AqkAkk.unbind(1)
        parts.update(eR=eR, eC=eC, Lr=Lr, Kc=Kc)
    else:
        # Pairwise decays exp(G_r - G_s) for r >= s only: each factor is <= 1 for g <= 0, so a hard
        # reset (g = -1000) underflows to 0 instead of overflowing, which prefix-product division
        # (K / Gamma) would do.
        diff = G[:, :, None, :] - G[:, None, :, :]  # [HV,n(r),n(s),K]
        ninf = torch.full((), float("-inf"), dtype=dt, device=dev)
        E = torch.where(incl[None, :, :, None], diff, ninf).exp()
        Ek = E * kc[:, None, :, :]  # k_s exp(G_r - G_s), [HV,n,n,K]
        Aqk = torch.einsum("hrd,hrsd->hrs", qc, Ek)  # includes diagonal and (pre-applied) scale
        Akk = torch.einsum("hrd,hrsd->hrs", kc, Ek)
        parts.update(E=E, Ek=Ek)
    L = torch.where(strict, bc[:, :, None] * Akk, zero)  # beta on the row
    eye = torch.eye(n, dtype=dt, device=dev).expand(qc.shape[0], n, n)
    Tinv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
    A = Tinv * bc[:, None, :]  # Tinv diag(beta)
    eG = G.exp()  # <= 1
    KE = kc * eG
    W = A @ KE  # [HV,n,K]
    U = A @ vc  # [HV,n,V]
    v_new = U - _state_mm(W, S, mm_dtype, dt)
    g_last = G[:, -1:, :]  # cumsum at the last valid token of this (possibly partial) chunk
    eL = (g_last - G).exp()  # <= 1
    parts.update(Aqk=Aqk, Akk=Akk, Tinv=Tinv, A=A, eG=eG, KE=KE, W=W, v_new=v_new, g_last=g_last, eL=eL,
                 kg=kc * eL)
    return parts


def chunk_step(
    qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk of n <= C tokens, all value heads: inputs [HV,n,*], state S [HV,K,V] -> (o [HV,n,V], S)."""
    c = chunk_parts(qc, kc, vc, gc, bc, S)
    o = (qc * c["eG"]) @ S + c["Aqk"] @ c["v_new"]
    S = c["g_last"].transpose(1, 2).exp() * S + c["kg"].transpose(1, 2) @ c["v_new"]
    return o, S


def chunk_stage_backward(
    qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor, doc: Tensor, dS: Tensor, *,
    anchored: bool = False, state_grad: bool = True, mm_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """The backward of `chunk_step` by FLA's stage formulas (kda-math §8), for one chunk (inputs [HV,n,*],
    S the state entering it, dS the gradient of the state leaving it). Stage 1 recomputes the forward;
    stage 2: dAqk = tril(dO V_new^T); stage 4 (the reverse scan): dV_new = Aqk^T dO + Kg dS' and
    dS = (Q * exp(G))^T dO + exp(G_last) * dS' - W^T dV_new; stage 5 (the WY form): dU = dV_new,
    dW = -dV_new S^T, dA = dU V^T + dW (K * exp(G))^T, dv = A^T dU, the inverse's
    dL = -Tinv^T (dA diag(beta)) Tinv^T on the strict lower triangle, dbeta from A's columns and L's rows;
    stage 6 (intra-chunk): dAqk and dAkk = beta_r dL back to q, k and the pairwise decays; stage 8: dg is the
    reverse cumsum of the gradient of the chunk-local cumsum G. Returns dq, dk, dv, dg, dbeta (of the chunk's
    inputs), dS (entering the chunk; only with ``state_grad``) and dAqk.

    ``anchored`` computes stages 1 and 6 in `chunk_parts`'s anchored form: batched [n,n] x [n,K] matmuls, no
    [HV,n,n,K] tensor, for inputs with g >= -5 and n <= 16 only (the safe gate; not hard resets).

    The [HV,K,V] states are the largest tensors by far, so each is read by as few products as possible, and
    the only [HV,K,V] tensors built are the entering state's gradient (which ``state_grad=False`` skips, with
    everything only it needs), the states' casts to ``mm_dtype``, and a copy of a state that is not row-major
    in (K, V) for sum_v S dS'. ``mm_dtype`` (None: the inputs' dtype) is the dtype of the operands of the
    products with S and dS: W S, Kg dS', [-dV_new; dO] S^T, V_new dS'^T and the g_last term's sum_v S dS'.
    bf16 runs them on tensor cores with fp32 accumulation (`_state_mm`), as FLA's backward keeps its states in
    bf16 (kda-math §9); S and dS are cast once, to row-major [HV,K,V], or arrive so. The solves, the decays
    and every other product stay in the inputs' dtype, as does the entering state's gradient."""
    dt = qc.dtype
    n = qc.shape[1]
    if mm_dtype == dt:
        mm_dtype = None
    if mm_dtype is not None:  # no copy for a state cast already
        S_mm, dS_mm = (x.to(mm_dtype, memory_format=torch.contiguous_format) for x in (S, dS))
    else:
        S_mm, dS_mm = S, dS
    # sum_v S dS' (of exp(G_last) on the state) first: a state in another layout is copied for it, and that
    # copy is freed before the chunk's own intermediates are built.
    S_dS = _row_dot(S_mm, dS_mm, mm_dtype, dt)
    c = chunk_parts(qc, kc, vc, gc, bc, S_mm, anchored=anchored, mm_dtype=mm_dtype)
    incl, Aqk, A = c["incl"], c["Aqk"], c["A"]
    eG, KE, W, v_new, g_last, kg = (c[x] for x in ("eG", "KE", "W", "v_new", "g_last", "kg"))
    zero = torch.zeros((), dtype=dt, device=qc.device)
    # stages 2 and 4
    dv_new = Aqk.transpose(1, 2) @ doc + _state_mm(kg, dS_mm, mm_dtype, dt)
    dAqk = torch.where(incl, doc @ v_new.transpose(1, 2), zero)
    grads: dict[str, Tensor] = {}
    if state_grad:
        # One [K,2n] x [2n,V] product for both token terms, then exp(G_last) * dS' added in place: the only
        # [HV,K,V] tensor built is the result.
        dS_in = torch.cat((qc * eG, -W), dim=1).transpose(1, 2) @ torch.cat((doc, dv_new), dim=1)
        grads["dS"] = dS_in.addcmul_(g_last.transpose(1, 2).exp(), dS)
    # stage 5: through U = A V, W = A (K * exp(G)), A = Tinv diag(beta), Tinv = (I + L)^-1. dW and dQg (of
    # Q * exp(G), the inter-chunk term of o) are one product with S^T, which reads S once.
    dW, dQg = _state_mm(torch.cat((-dv_new, doc), dim=1), S_mm.transpose(1, 2), mm_dtype, dt).split(n, dim=1)
    dA = dv_new @ vc.transpose(1, 2) + dW @ KE.transpose(1, 2)
    dv = A.transpose(1, 2) @ dv_new
    dKE = A.transpose(1, 2) @ dW
    dkg = _state_mm(v_new, dS_mm.transpose(1, 2), mm_dtype, dt)
    tail = backward_from_dA(c, qc, kc, bc, dA, dAqk, dQg, dKE, dkg, S_dS, anchored=anchored)
    return {**tail, "dv": dv, **grads, "dAqk": dAqk}


def backward_from_dA(c: dict[str, Tensor], qc: Tensor, kc: Tensor, bc: Tensor, dA: Tensor, dAqk: Tensor,
                     dQg: Tensor, dKE: Tensor, dkg: Tensor, S_dS: Tensor, *,
                     anchored: bool = False) -> dict[str, Tensor]:
    """The backward's stages after dA (kda-math §8, stages 5 to 8), shared by `chunk_stage_backward` and
    `kdagen.tile_grads`: from `chunk_parts`' intermediates ``c`` and the gradients of A = Tinv diag(beta)
    (``dA``), of Aqk (``dAqk``, masked), of Q * exp(G) (``dQg``), of K * exp(G) (``dKE``), of
    K * exp(G_last - G) (``dkg``) and the row sums of S * dS' (``S_dS``, [Bt, K]): the inverse's dL and
    dbeta, the intra-chunk products back to q, k and the decays, and dg by the reverse cumsum. Returns dq,
    dk, dg and dbeta."""
    n = qc.shape[1]
    strict, Akk, Tinv = c["strict"], c["Akk"], c["Tinv"]
    eG, KE, g_last, eL, kg = (c[x] for x in ("eG", "KE", "g_last", "eL", "kg"))
    zero = torch.zeros((), dtype=qc.dtype, device=qc.device)
    dbeta = (dA * Tinv).sum(dim=1)  # A's column s carries beta_s
    dL = torch.where(strict, -Tinv.transpose(1, 2) @ (dA * bc[:, None, :]) @ Tinv.transpose(1, 2), zero)
    dbeta = dbeta + (dL * Akk).sum(dim=2)  # L's row r carries beta_r
    dAkk = dL * bc[:, :, None]
    # stage 6: the pairwise products back to q, k and the decays exp(G_r - G_s)
    if anchored:
        # With E_rs = eR_r eC_s: the row sides sum over s, dq_r = eR_r sum_s dAqk_rs (K eC)_s and the k-row
        # term of Akk likewise; the column side sums over r, eC_s sum_r (dAqk_rs (Q eR)_r + dAkk_rs (K eR)_r).
        # The decays' gradient dE.sum(s) - dE.sum(r) of the pairwise form is then q dq_row + k dk_row on the
        # rows minus k dk_col on the columns.
        K = qc.shape[2]
        dA2 = torch.cat((dAqk, dAkk), dim=1)  # [HV,2n,n]
        dq_row, dk_row = ((dA2 @ c["Kc"]).view(qc.shape[0], 2, n, K) * c["eR"][:, None]).unbind(1)
        dk_col = (dA2.transpose(1, 2) @ c["Lr"]) * c["eC"]
        dq = dQg * eG + dq_row
        dk = dk_row + dk_col + dKE * eG
        dG = qc * dq_row + kc * (dk_row - dk_col) + dKE * KE + dQg * qc * eG
    else:
        E = c["E"]
        dq = dQg * eG + torch.einsum("hrs,hsd,hrsd->hrd", dAqk, kc, E)
        dk = (torch.einsum("hrs,hrd,hrsd->hsd", dAqk, qc, E) + torch.einsum("hrs,hsd,hrsd->hrd", dAkk, kc, E)
              + torch.einsum("hrs,hrd,hrsd->hsd", dAkk, kc, E) + dKE * eG)
        dE = dAqk[..., None] * qc[:, :, None, :] + dAkk[..., None] * kc[:, :, None, :]
        dE = dE * kc[:, None, :, :] * E
        dG = dE.sum(dim=2) - dE.sum(dim=1) + dKE * KE + dQg * qc * eG
    # the inter-chunk decays: kg = K * exp(G_last - G) and exp(G_last) on the state
    dk = dk + dkg * eL
    dG = dG - dkg * kg
    dG[:, -1, :] += (dkg * kg).sum(dim=1) + S_dS * g_last[:, 0, :].exp()
    # stage 8: G is the chunk-local cumsum of g
    dg = dG.flip(1).cumsum(dim=1).flip(1)
    return {"dq": dq, "dk": dk, "dg": dg, "dbeta": dbeta}
