"""MixedPrecision's eager torch twin and its tolerance, for the precision tests, the strategy matrix and the matrix."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

LR, WD = 1e-3, 0.01
# Measured spread of losses against the eager-torch twin over 6 AdamW steps (lr 1e-3): 1.8e-4 (blocks),
# 1.1e-4 (Llama). XLA on CPU computes bf16 dots in fp32, torch on CPU in bf16, hence the gap; fixed at 1e-3.
RTOL = 1e-3


def blocks_loss(model, ids):
    """Next-token cross entropy of a `BlockStack`, in fp32."""
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def torch_mixed_precision(master, loss_fn, data):
    """The same policy in eager torch: forward and backward on a bf16 copy, fp32 AdamW on the master."""
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for batch in data:
        low = copy.deepcopy(master).to(torch.bfloat16)
        loss = loss_fn(low, batch)
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.float()  # a parameter the loss does not use has none
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return np.array(losses)
