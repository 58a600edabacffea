/* MPI_IN_PLACE is a macro whose value differs between MPI implementations (Open MPI's
   (void *) 1, MPICH's (void *) -1), and the mpi crate does not export it: read it here,
   compiled against the same mpi.h as the library that is linked. */
#include <mpi.h>

void *burnscale_mpi_in_place(void) { return MPI_IN_PLACE; }
