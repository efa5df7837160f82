"""metaroce_operator: the kopf operator that turns MetaRoceNetworks into node agents.

Rendering (`render`), status aggregation (`status`), taint and conflict decisions are
pure functions; `state` keeps what the leader knows, one object per concern;
`controller` does the leader's I/O; `handlers` only registers kopf callbacks, which reach
the controller over the `bridge`; `app` runs the leader-elected process. See DESIGN.md,
operator/.
"""

__version__ = "0.1.0"
