"""megatron-core's global state for one run: :mod:`.parallel` initialises ``parallel_state`` and
builds the run's process groups (passed around as :class:`~.parallel.ProcessGroups`), and
:mod:`.cpu_compat` bends megatron-core to run without CUDA. Once initialised, ``parallel_state``
is read elsewhere too: the models (the embedding group, the tensor-parallel rank) and the launch
(the pipeline rank a metrics endpoint reports)."""
