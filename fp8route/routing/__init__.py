"""Measured routing: device fingerprints, the tuner, persisted routing tables, and route(model)."""

from fp8route.routing.apply import route
from fp8route.routing.choose import MIN_TIE, Timing, choose
from fp8route.routing.fingerprint import Fingerprint
from fp8route.routing.shapes import LayerShape, model_shapes, parse_shapes
from fp8route.routing.store import default_path, load_table, read_table, save_table
from fp8route.routing.table import RoutingTable, RoutingTableError, ShapeRoutes
from fp8route.routing.tuner import Tuner

__all__ = [
    "MIN_TIE",
    "Fingerprint",
    "LayerShape",
    "RoutingTable",
    "RoutingTableError",
    "ShapeRoutes",
    "Timing",
    "Tuner",
    "choose",
    "default_path",
    "load_table",
    "model_shapes",
    "parse_shapes",
    "read_table",
    "route",
    "save_table",
]
