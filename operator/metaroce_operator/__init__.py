"""metaroce_operator: the kopf operator that turns MetaRoceNetworks into node agents.

Rendering (`render`), status aggregation (`status`), taint and conflict decisions are
pure functions; `handlers` only registers kopf callbacks; `app` runs the leader-elected
process. See DESIGN.md, operator/.
"""

__version__ = "0.1.0"
