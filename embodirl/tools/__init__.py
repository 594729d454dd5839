"""Tools that look at a config before anything runs: ``embodirl doctor``'s set-up checks (:mod:`.doctor`), the memory
estimate they use (:mod:`.memory_plan`) and the full-size dry run on PyTorch's meta device (:mod:`.dry_run`)."""
