"""Edge side: local training procedures, the board agent, its resource monitor and service unit."""
