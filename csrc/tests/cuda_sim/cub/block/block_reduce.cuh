// CUB's BlockReduce, simulated on the host: see ../../cub_stand_in.h.
#pragma once
#include "../../cub_stand_in.h"
