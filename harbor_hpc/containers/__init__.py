"""Task containers, whatever runtime starts them: their own roots, networks, pods, watchdog and
command channel, the .sif store (`convert`), and the Harbor environment that runs tasks."""
