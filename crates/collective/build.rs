//! With the `mpi` feature: compiles `csrc/in_place.c`, which reads MPI_IN_PLACE from the MPI
//! library's own header, as the `mpi` crate builds its C shim.

fn main() {
    println!("cargo:rerun-if-changed=csrc/in_place.c");
    #[cfg(feature = "mpi")]
    {
        // The `mpi` crate's own build has found the library already; this cannot fail where
        // that one succeeded.
        let lib = build_probe_mpi::probe().unwrap_or_else(|errors| {
            panic!("no MPI library found: {errors:?}");
        });
        let mut build = cc::Build::new();
        build.file("csrc/in_place.c");
        match lib.mpicc {
            Some(mpicc) => {
                build.compiler(mpicc);
            }
            None => {
                build.includes(&lib.include_paths);
            }
        }
        build.compile("burnscale_mpi_in_place");
    }
}
