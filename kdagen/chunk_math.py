"""The formulas of one 16-token (or any n-token) chunk of the KDA forward and of its backward (kda-math
§2.3-§2.5, §8), in plain torch.

Every function is generic in the dtype and in the leading dim: inputs are ``[Bt, n, *]`` per chunk, where Bt
is any batch (the value heads of one chunk in the references, tiles times value heads in
:mod:`kdagen.backward_local`), and states ``[Bt, K, V]``. Nothing here loops over chunks or sequences.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_parts", "chunk_stage_backward", "chunk_step"]

Tensor = torch.Tensor


def chunk_parts(qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor) -> dict[str, Tensor]:
    """The intermediates of one chunk of n <= C tokens, all value heads (inputs [HV,n,*], the state S [HV,K,V]
    entering it): what the forward computes and the backward recomputes (stage 1 of kda-math §8)."""
    n = qc.shape[1]
    dev, dt = qc.device, qc.dtype
    G = gc.cumsum(dim=1)  # chunk-local inclusive cumsum (natural log), [HV,n,K]
    rows = torch.arange(n, device=dev)
    incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    # Pairwise decays exp(G_r - G_s) for r >= s only: each factor is <= 1 for g <= 0, so a hard reset
    # (g = -1000) underflows to 0 instead of overflowing, which prefix-product division (K / Gamma) would do.
    diff = G[:, :, None, :] - G[:, None, :, :]  # [HV,n(r),n(s),K]
    E = torch.where(incl[None, :, :, None], diff, torch.full((), float("-inf"), dtype=dt, device=dev)).exp()
    Ek = E * kc[:, None, :, :]  # k_s exp(G_r - G_s), [HV,n,n,K]
    Aqk = torch.einsum("hrd,hrsd->hrs", qc, Ek)  # includes diagonal and (pre-applied) scale
    Akk = torch.einsum("hrd,hrsd->hrs", kc, Ek)
    L = torch.where(strict, bc[:, :, None] * Akk, torch.zeros((), dtype=dt, device=dev))  # beta on the row
    eye = torch.eye(n, dtype=dt, device=dev).expand(qc.shape[0], n, n)
    Tinv = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
    A = Tinv * bc[:, None, :]  # Tinv diag(beta)
    eG = G.exp()  # <= 1
    KE = kc * eG
    W = A @ KE  # [HV,n,K]
    U = A @ vc  # [HV,n,V]
    v_new = U - W @ S
    g_last = G[:, -1:, :]  # cumsum at the last valid token of this (possibly partial) chunk
    eL = (g_last - G).exp()  # <= 1
    return {"incl": incl, "strict": strict, "E": E, "Ek": Ek, "Aqk": Aqk, "Akk": Akk, "Tinv": Tinv, "A": A,
            "eG": eG, "KE": KE, "W": W, "v_new": v_new, "g_last": g_last, "eL": eL, "kg": kc * eL}


def chunk_step(
    qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk of n <= C tokens, all value heads: inputs [HV,n,*], state S [HV,K,V] -> (o [HV,n,V], S)."""
    c = chunk_parts(qc, kc, vc, gc, bc, S)
    o = (qc * c["eG"]) @ S + c["Aqk"] @ c["v_new"]
    S = c["g_last"].transpose(1, 2).exp() * S + c["kg"].transpose(1, 2) @ c["v_new"]
    return o, S


def chunk_stage_backward(
    qc: Tensor, kc: Tensor, vc: Tensor, gc: Tensor, bc: Tensor, S: Tensor, doc: Tensor, dS: Tensor
) -> dict[str, Tensor]:
    """The backward of `chunk_step` by FLA's stage formulas (kda-math §8), for one chunk (inputs [HV,n,*],
    S the state entering it, dS the gradient of the state leaving it). Stage 1 recomputes the forward;
    stage 2: dAqk = tril(dO V_new^T); stage 4 (the reverse scan): dV_new = Aqk^T dO + Kg dS' and
    dS = (Q * exp(G))^T dO + exp(G_last) * dS' - W^T dV_new; stage 5 (the WY form): dU = dV_new,
    dW = -dV_new S^T, dA = dU V^T + dW (K * exp(G))^T, dv = A^T dU, the inverse's
    dL = -Tinv^T (dA diag(beta)) Tinv^T on the strict lower triangle, dbeta from A's columns and L's rows;
    stage 6 (intra-chunk): dAqk and dAkk = beta_r dL back to q, k and the pairwise decays; stage 8: dg is the
    reverse cumsum of the gradient of the chunk-local cumsum G. Returns dq, dk, dv, dg, dbeta (of the chunk's
    inputs), dS (entering the chunk) and dAqk."""
    c = chunk_parts(qc, kc, vc, gc, bc, S)
    incl, strict, E, Aqk, Akk, Tinv, A = (c[x] for x in ("incl", "strict", "E", "Aqk", "Akk", "Tinv", "A"))
    eG, KE, W, v_new, g_last, eL, kg = (c[x] for x in ("eG", "KE", "W", "v_new", "g_last", "eL", "kg"))
    zero = torch.zeros((), dtype=qc.dtype, device=qc.device)
    # stages 2 and 4
    dv_new = Aqk.transpose(1, 2) @ doc + kg @ dS
    dAqk = torch.where(incl, doc @ v_new.transpose(1, 2), zero)
    dS_in = (qc * eG).transpose(1, 2) @ doc + g_last.transpose(1, 2).exp() * dS - W.transpose(1, 2) @ dv_new
    # stage 5: through U = A V, W = A (K * exp(G)), A = Tinv diag(beta), Tinv = (I + L)^-1
    dW = -dv_new @ S.transpose(1, 2)
    dA = dv_new @ vc.transpose(1, 2) + dW @ KE.transpose(1, 2)
    dv = A.transpose(1, 2) @ dv_new
    dKE = A.transpose(1, 2) @ dW
    dbeta = (dA * Tinv).sum(dim=1)  # A's column s carries beta_s
    dL = torch.where(strict, -Tinv.transpose(1, 2) @ (dA * bc[:, None, :]) @ Tinv.transpose(1, 2), zero)
    dbeta = dbeta + (dL * Akk).sum(dim=2)  # L's row r carries beta_r
    dAkk = dL * bc[:, :, None]
    # stage 6: the pairwise products back to q, k and the decays exp(G_r - G_s)
    dQg = doc @ S.transpose(1, 2)  # of Q * exp(G), the inter-chunk term of o
    dq = dQg * eG + torch.einsum("hrs,hsd,hrsd->hrd", dAqk, kc, E)
    dk = (torch.einsum("hrs,hrd,hrsd->hsd", dAqk, qc, E) + torch.einsum("hrs,hsd,hrsd->hrd", dAkk, kc, E)
          + torch.einsum("hrs,hrd,hrsd->hsd", dAkk, kc, E) + dKE * eG)
    dE = (dAqk[..., None] * qc[:, :, None, :] + dAkk[..., None] * kc[:, :, None, :]) * kc[:, None, :, :] * E
    dG = dE.sum(dim=2) - dE.sum(dim=1) + dKE * KE + dQg * qc * eG
    # the inter-chunk decays: kg = K * exp(G_last - G) and exp(G_last) on the state
    dkg = v_new @ dS.transpose(1, 2)
    dk = dk + dkg * eL
    dG = dG - dkg * kg
    dG[:, -1, :] += (dkg * kg).sum(dim=1) + (S * dS).sum(dim=2) * g_last[:, 0, :].exp()
    # stage 8: G is the chunk-local cumsum of g
    dg = dG.flip(1).cumsum(dim=1).flip(1)
    return {"dq": dq, "dk": dk, "dv": dv, "dg": dg, "dbeta": dbeta, "dS": dS_in, "dAqk": dAqk}
