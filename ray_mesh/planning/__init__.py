"""Planning on the driver (Ray-free): which nodes and which mesh a cluster's resources give."""
