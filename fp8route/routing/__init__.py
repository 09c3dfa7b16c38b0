"""Measured routing: device fingerprints, routing tables and where they live, and route(model).

Nothing here times anything: tables are made by fp8route.tuning and only read here.
"""

from fp8route.routing.apply import route
from fp8route.routing.choose import MIN_TIE, Timing, choose
from fp8route.routing.fingerprint import Fingerprint
from fp8route.routing.store import default_path, load_table, read_table, save_table
from fp8route.routing.table import RoutingTable, RoutingTableError, ShapeRoutes

__all__ = [
    "MIN_TIE",
    "Fingerprint",
    "RoutingTable",
    "RoutingTableError",
    "ShapeRoutes",
    "Timing",
    "choose",
    "default_path",
    "load_table",
    "read_table",
    "route",
    "save_table",
]
