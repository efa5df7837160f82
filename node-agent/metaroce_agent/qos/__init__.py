"""QoS knob families, one module each: desired state -> steps (apply, verify, undo).

- `dcb`: iproute2 `dcb` app (DSCP trust and mapping), pfc, ets, where the driver has DCB;
- `ecn`: mlx5-style per-priority ECN and CNP knobs in sysfs, where present;
- `rocecm`: rdma_cm configfs `default_roce_tos` and `default_roce_mode` per RDMA device;
- `mtu`: netdev MTU through netlink;
- `tcmark`: DSCP marking and priority mapping with `tc` on netdevs without DCB (SoftRoCE).
"""
