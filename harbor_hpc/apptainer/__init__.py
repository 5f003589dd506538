"""The Apptainer side: the .sif store (`convert`) and the Harbor environment that runs tasks."""
