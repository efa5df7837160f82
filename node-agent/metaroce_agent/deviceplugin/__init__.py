"""The kubelet device plugin of one network (API v1beta1 over unix sockets, grpcio).

- `devices`: pure logic: `PluginDevice` (the agent's input), units and their IDs, health,
  Allocate and GetPreferredAllocation answers; documents what one unit means.
- `plugin`: `DevicePlugin` (servicer, registration, re-registration on kubelet restart)
  and `PluginConfig`; documents how the agent loop drives it.
- `feed`: `plugin_devices`, the pure function the agent loop builds the device list with
  (from discovery, the plan and the apply/drift results).
- `api.proto` + generated `api_pb2*.py`: the kubelet's API (`gen.py` regenerates them).
"""

from metaroce_agent.deviceplugin.devices import PluginDevice
from metaroce_agent.deviceplugin.plugin import DevicePlugin, PluginConfig, PluginStatus

__all__ = ["DevicePlugin", "PluginConfig", "PluginDevice", "PluginStatus"]
