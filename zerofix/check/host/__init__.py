"""What ranks need of this CPU host, apart from the scenarios and the launcher (issue 68): the environment they run in
(``env``), DeepSpeed's shared-memory segments cleared after a session (``shm``), its CPU op built ahead (``prebuild``)
and stale build locks cleared (``jitlock``), and a count of the collectives its engines run (``collectives``). Nothing
here imports the launcher or a scenario."""
