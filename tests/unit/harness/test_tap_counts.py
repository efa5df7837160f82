"""The bridge's per-tap counters as the L2 report and l2_counters() read them."""

from metaroce_harness.guests import TapCounts, tap_counts

# /proc/net/dev: two header lines, then per device 8 receive and 8 transmit fields
PROC_NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop ...
    lo: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
   br0: 140 2 0 0 0 0 0 0 0 0 0 0 0 0 0 0
  tap0: 9000000 6000 0 3 0 0 0 0 8000000 5000 0 7 0 0 0 0
  tap1: 800000 500 0 0 0 0 0 0 9100000 6100 0 0 0 0 0 0
"""


def test_each_tap_reads_what_its_guest_sent_and_was_sent() -> None:
    taps = tap_counts(PROC_NET_DEV)
    assert taps == {
        "tap0": TapCounts(from_guest=6000, from_guest_dropped=3, to_guest=5000, to_guest_dropped=7),
        "tap1": TapCounts(from_guest=500, from_guest_dropped=0, to_guest=6100, to_guest_dropped=0),
    }
    assert taps["tap0"].describe() == (
        "from guest 6000 frames (3 dropped), to guest 5000 frames (7 dropped)"
    )


def test_no_taps_no_counts() -> None:
    assert tap_counts(PROC_NET_DEV.replace("tap", "eth")) == {}
