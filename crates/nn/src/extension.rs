//! The backends burnscale's own ops (those with a backward of their own) extend.

/// Declares `pub trait $name: Backend { .. }` as a Burn backend extension on the backends
/// burnscale runs on (Flex; Cube with the `cube` feature; LibTorch with `tch`; Autodiff, whose
/// impl each op writes by hand with its backward), with the trait's default bodies as the
/// plain backends' impls; `lazy` before the trait leaves cubecl's to the caller, behind one
/// Fusion op. The trait is declared in a module of its own (`extension`), which sees the
/// caller's imports.
macro_rules! backend_ops {
    ($(#[$meta:meta])* pub trait $name:ident { $($body:tt)* }) => {
        backend_ops!(@declare [Cube: cfg(feature = "cube")] $(#[$meta])* pub trait $name { $($body)* });
        #[cfg(feature = "cube")]
        impl $name for burn::backend::Cube {}
    };
    // Under Fusion each call becomes one opaque op (each method says its output with
    // `#[fusion(..)]`), run by cubecl's own backend, whose impl the caller writes.
    (lazy $(#[$meta:meta])* pub trait $name:ident { $($body:tt)* }) => {
        backend_ops!(
            @declare [Cube: cfg(feature = "cube"), Fusion: cfg(feature = "cube")]
            $(#[$meta])* pub trait $name { $($body)* }
        );
    };
    (@declare [$($cube:tt)*] $(#[$meta:meta])* pub trait $name:ident { $($body:tt)* }) => {
        pub use extension::$name;

        mod extension {
            // burn-tch is deprecated in Burn 0.22, and kept to compare with
            // (`--accelerator libtorch`).
            #![allow(deprecated)]

            use super::*;

            $(#[$meta])*
            #[burn::backend::backend_extension(
                Flex,
                $($cube)*,
                LibTorch: cfg(feature = "tch"),
                Autodiff,
            )]
            pub trait $name: burn::backend::Backend {
                $($body)*
            }

            impl $name for burn::backend::Flex {}
            #[cfg(feature = "tch")]
            impl $name for burn::backend::LibTorch {}
        }
    };
}
