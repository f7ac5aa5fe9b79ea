"""Try and test the operator without a cluster: ``omni sandbox up`` (see :mod:`.cluster`)."""
