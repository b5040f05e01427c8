"""The live record's fingerprint (`unbroken.healing.records.fingerprint`): what tells a
live rank's state from the state its last record was made of, every step."""

from __future__ import annotations

import torch
from torch import nn

from unbroken.healing import records


def test_the_fingerprint_follows_the_tensors_values_through_its_kept_views():
    """The fingerprint keeps its sample views between steps: it must still see every
    change, in place (through ``.data`` too), a tensor replaced by another at a new
    address, and a tensor that is not contiguous (sampled by copy, never kept)."""
    model = nn.Linear(64, 32)
    optim = torch.optim.Adam(model.parameters())
    transposed = torch.zeros(4, 4).t()  # not contiguous
    model.register_buffer("transposed", transposed)
    state = {"model": model, "optim": optim}
    model(torch.ones(1, 64)).sum().backward()
    optim.step()
    seen = [records.fingerprint(state)]
    assert records.fingerprint(state) == seen[0], "the same values, the same fingerprint"
    optim.step()
    seen.append(records.fingerprint(state))
    model.weight.data[0, 0] += 1  # not the elements sampled only: the first one is
    seen.append(records.fingerprint(state))
    model.weight.data = model.weight.data.clone()  # the same values at a new address
    assert records.fingerprint(state) == seen[-1]
    model.weight.data[0, 0] += 1  # the new tensor is the one read
    seen.append(records.fingerprint(state))
    model.bias.data = model.bias.data.clone() + 1
    seen.append(records.fingerprint(state))
    optim.state[model.weight]["exp_avg"][0, 0] += 1
    seen.append(records.fingerprint(state))
    transposed[0, 0] += 1
    seen.append(records.fingerprint(state))
    assert len(set(seen)) == len(seen), seen
