//! The backends burnscale's own ops (those with a backward of their own) extend.

/// Declares `pub trait $name: Backend { .. }` as a Burn backend extension on the backends
/// burnscale runs on (Flex; Cube with the `cube` feature; LibTorch with `tch`; Autodiff, whose
/// impl each op writes by hand with its backward), with the trait's default bodies as the
/// plain backends' impls. The trait is declared in a module of its own (`extension`), which
/// sees the caller's imports.
macro_rules! backend_ops {
    ($(#[$meta:meta])* pub trait $name:ident { $($body:tt)* }) => {
        pub use extension::$name;

        mod extension {
            // burn-tch is deprecated in Burn 0.22, and kept to compare with
            // (`--accelerator libtorch`).
            #![allow(deprecated)]

            use super::*;

            $(#[$meta])*
            #[burn::backend::backend_extension(
                Flex,
                Cube: cfg(feature = "cube"),
                LibTorch: cfg(feature = "tch"),
                Autodiff,
            )]
            pub trait $name: burn::backend::Backend {
                $($body)*
            }

            impl $name for burn::backend::Flex {}
            #[cfg(feature = "cube")]
            impl $name for burn::backend::Cube {}
            #[cfg(feature = "tch")]
            impl $name for burn::backend::LibTorch {}
        }
    };
}
