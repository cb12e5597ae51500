"""How an owner settles: plain, transactional (with its retries), and the lease heartbeat.

``settle`` is the entry point the request lifecycle and ``once()`` use; the
modules below it are ``plain`` (store or release), ``transactional`` (the view in
a unit of work, C40/C43), ``unit`` (that unit), ``heartbeat`` (lease renewal,
C44) and ``ownership`` (what one owner carries until it settles).
"""
