"""Parallelism for one node: data-parallel groups, FSDP2 sharding and Ulysses sequence parallelism.

- ``dims``: the validated degrees (``ParallelDims``) and the ``("dp", "sp")`` device mesh.
- ``ulysses``: the all-to-all exchange the packed layers call as ``sp`` (tokens <-> heads).
- ``parallelize``: applies FSDP2 to a loaded packed model from the outside.
- ``runner``: scores one packed row on a group of ranks (padding, shard, head, gather).

Nothing here is imported by the model files; parallelism is applied to them from outside.
"""
