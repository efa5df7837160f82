"""Guest side: what pyverbs sees of the RDMA devices, as JSON on stdout.

Run with the guest's python3 (Debian's pyverbs): python3 rdma_info.py [DEVICE...]
"""

import json
import sys

import pyverbs.device as d
import pyverbs.enums as e

GID_TYPES = {
    e.IBV_GID_TYPE_IB: "IB",
    e.IBV_GID_TYPE_ROCE_V1: "RoCE v1",
    e.IBV_GID_TYPE_ROCE_V2: "RoCE v2",
}


def describe(name: str) -> dict:
    ctx = d.Context(name=name)
    attr = ctx.query_device()
    ports = {}
    for port in range(1, attr.phys_port_cnt + 1):
        pattr = ctx.query_port(port)
        gids = []
        for index in range(pattr.gid_tbl_len):
            try:
                entry = ctx.query_gid_ex(port, index)
            except Exception:  # an empty slot: the table is sparse, stop at the first hole
                break
            gids.append(
                {
                    "index": entry.gid_index,
                    "gid": entry.gid_str(),
                    "type": GID_TYPES.get(entry.gid_type, str(entry.gid_type)),
                    "ifindex": entry.ndev_ifindex,
                }
            )
        ports[port] = {
            "state": pattr.state,
            "active": pattr.state == e.IBV_PORT_ACTIVE,
            "active_mtu": pattr.active_mtu,
            "link_layer": pattr.link_layer,
            "gids": gids,
        }
    ctx.close()
    return {"name": name, "node_guid": attr.node_guid, "ports": ports}


def main() -> None:
    wanted = sys.argv[1:]
    names = [dev.name.decode() for dev in d.get_device_list()]
    devices = [describe(n) for n in names if not wanted or n in wanted]
    json.dump({"devices": devices}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
