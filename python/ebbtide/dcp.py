"""torch.distributed.checkpoint storage plugin on ebbtide's I/O engine: the
public names (docs/checkpoints.md, "torch.distributed.checkpoint").

    import torch.distributed.checkpoint as dcp
    from ebbtide.dcp import EbbtideReader, EbbtideWriter
    dcp.save(state, storage_writer=EbbtideWriter("/ckpt/step100"))
    dcp.load(state, storage_reader=EbbtideReader("/ckpt/step100"))

The plugin lives in ebbtide/checkpoint/ (dcp_writer.py, dcp_staging.py, dcp_reader.py and the
layout in dcp_format.py).
"""
from ebbtide.checkpoint.dcp_format import load_metadata, rank_metadata_ranks
from ebbtide.checkpoint.dcp_reader import EbbtideReader, inspect
from ebbtide.checkpoint.dcp_writer import EbbtideWriter

__all__ = ["EbbtideWriter", "EbbtideReader", "load_metadata", "rank_metadata_ranks", "inspect"]
