"""Tools beside training: the rank map, one rank's build, the schedule picture, checkpoint conversion, generation."""
