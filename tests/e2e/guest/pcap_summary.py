"""Guest side: the RoCE v2 packets of a pcap file (from tcpdump -w), as JSON.

    python3 pcap_summary.py FILE

For every IPv4/UDP packet to port 4791 it reports source, destination, the IP ToS byte,
the BTH opcode and destination QP (QP 1 carries the rdma_cm MADs). Also counts them by
(src, dst, tos, kind) where kind is "cm" (QP 1) or "data".
"""

import json
import struct
import sys
from collections import Counter

ROCE_V2_PORT = 4791


def packets(path: str):
    with open(path, "rb") as f:
        data = f.read()
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        endian = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        endian = ">"
    else:
        raise SystemExit(f"{path} is not a pcap file")
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    if linktype != 1:
        raise SystemExit(f"{path}: link type {linktype}, expected Ethernet (capture on eth0)")
    pos = 24
    while pos + 16 <= len(data):
        _, _, caplen, _ = struct.unpack(endian + "IIII", data[pos : pos + 16])
        frame = data[pos + 16 : pos + 16 + caplen]
        pos += 16 + caplen
        yield frame


def roce(frame: bytes):
    if len(frame) < 14 + 20 + 8 + 12 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    if ip[9] != 17:
        return None
    udp = ip[ihl:]
    if struct.unpack("!H", udp[2:4])[0] != ROCE_V2_PORT:
        return None
    bth = udp[8:20]
    if len(bth) < 12:
        return None
    return {
        "src": ".".join(map(str, ip[12:16])),
        "dst": ".".join(map(str, ip[16:20])),
        "tos": ip[1],
        "sport": struct.unpack("!H", udp[0:2])[0],
        "opcode": bth[0],
        "dqpn": int.from_bytes(bth[5:8], "big"),
    }


def main() -> None:
    found = [p for p in (roce(f) for f in packets(sys.argv[1])) if p is not None]
    counts = Counter(
        (p["src"], p["dst"], p["tos"], "cm" if p["dqpn"] == 1 else "data") for p in found
    )
    json.dump(
        {
            "packets": len(found),
            "groups": [
                {"src": s, "dst": d, "tos": t, "kind": k, "count": n}
                for (s, d, t, k), n in sorted(counts.items())
            ],
            "first": found[:5],
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
