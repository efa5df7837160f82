"""LOCAL SHIM: names the operator needs that `metaroce_api.constants` does not have yet.

Each is requested from the API owner (see the operator's report). When the constant lands
in `metaroce_api.constants`, replace the value here by an import from there (or import it
at the use sites and delete this module); nothing else changes.
"""

from typing import Final

REASON_CLEANUP_TIMED_OUT: Final = "CleanupTimedOut"
"""Degraded: a deleted network's agents did not all report `reverted` in time."""
REASON_LOSSY_ON_GO_BACK_N: Final = "LossyProfileOnGoBackN"
"""Degraded: qos.profile lossy with a go-back-N transport (rocev2, softroce)."""
