"""One call that routes a whole model by measurement: load the table for each layer's device and
replan every Fp8Linear with it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from fp8route.linear.layer import Fp8Linear
from fp8route.routing.store import load_table
from fp8route.routing.table import RoutingTable

log = logging.getLogger("fp8route")


def route(model: nn.Module, table: RoutingTable | Path | str | None = None) -> nn.Module:
    """Replan every Fp8Linear in model by a routing table and return the model.

    table: a RoutingTable, a path to one, or None for this machine's table for each layer's GPU
    (user cache, else shipped defaults; see fp8route.routing.store). Layers with no table that
    applies keep the default priority; explain() shows each layer's source.
    """
    loaded: dict[torch.device, RoutingTable | None] = {}
    for module in model.modules():
        if not isinstance(module, Fp8Linear):
            continue
        device = module.weight.device
        if isinstance(table, RoutingTable):
            chosen: RoutingTable | None = table
        elif device.type != "cuda":
            chosen = None
        else:
            if device not in loaded:
                loaded[device] = load_table(device, path=table)
            chosen = loaded[device]
        if chosen is not None:
            module.replan(preference=chosen)
    return model
