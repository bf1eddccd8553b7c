"""numpyexample: a Flower app with numpy only (no gradients library), made private with dpfedavg."""
