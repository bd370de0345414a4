"""Starting processes: the rank runtime, the local launcher, worker daemons, the network, the doctor."""
