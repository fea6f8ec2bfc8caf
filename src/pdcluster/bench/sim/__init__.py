"""`pdcluster simulate`: a discrete-event simulation of a P/D cluster driven by a real trace, with the
operator's own autoscaler core (`pdcluster.operator.autoscaler.decide`) in the loop."""
