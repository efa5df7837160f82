"""Transport drivers: `rocev2` (hardware), `softroce` (rdma_rxe), `metaroce` (slot).

Each driver turns (config, inventory, capabilities, selected netdevs) into a
`TransportPlan`: the steps that bring the transport up, the RDMA devices it will serve,
and what stands in the way. `select.driver_for` picks one, resolving `auto`.
"""
