"""Typed doorway to the generated stubs (`api_pb2`, `api_pb2_grpc`).

The generated modules carry no type information (and protobuf ships no stubs), so they
are imported here as `Any`: the rest of the package stays under `mypy --strict` without
checking generated code.
"""

from __future__ import annotations

import importlib
from typing import Any

api_pb2: Any = importlib.import_module("metaroce_agent.deviceplugin.api_pb2")
api_pb2_grpc: Any = importlib.import_module("metaroce_agent.deviceplugin.api_pb2_grpc")

__all__ = ["api_pb2", "api_pb2_grpc"]
