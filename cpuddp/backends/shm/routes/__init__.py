"""backends.shm.routes: the route a shm group's collectives take, chosen once when it forms, and
where each call runs.

Owns: the route interface and the world route (:mod:`.route`); one node on the Python path and
several nodes through the hierarchy (:mod:`.route_node`); one node on the native path
(:mod:`.route_native`), its direct route from torch's call to one native call (:mod:`.direct`)
and its progress thread (:mod:`.progress`); the caller's thread or the communication thread, in
issue order, and the Works (:mod:`.stream`); what a queued call holds until it completes, its
tensors' memory (:mod:`.hold`); what a route runs a call through, the group's side of
it, made by the group and handed to its route (:mod:`.executor`); argument forms and size checks
(:mod:`.call_args`).
May import: :mod:`cpuddp.errors`, :mod:`cpuddp.backends.shm.native`, :mod:`cpuddp.backends.shm.protocol`,
:mod:`cpuddp.backends.shm.python`
"""
