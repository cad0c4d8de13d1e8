"""Writing capture files: the writer process, atomic files, writeback, shard manifest merges."""
