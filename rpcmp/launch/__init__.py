"""Starting processes: the rank runtime and its ending, the local launcher, worker daemons, the network, the doctor."""
