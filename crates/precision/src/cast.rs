//! Module-wide dtype changes that keep parameter ids, so gradients and optimizer state stay
//! addressable by parameter.

use std::sync::{Arc, OnceLock};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use burnscale_nn::autodiff_on;

/// `module` with every float parameter in `dtype`, each a fresh leaf (no graph back to the
/// original) on the same kind of device, requiring grad if the original did: the compute copy of mixed precision,
/// whose gradients arrive under the same ids, or a model's storage for `*-true`.
pub fn cast<M: Module>(module: M, dtype: FloatDType) -> M {
    module.map(&mut Cast {
        dtype,
        lazy_too: true,
    })
}

/// [`cast`] of the parameters already initialised; lazy ones are left as they are (and
/// initialise as their initialisers say).
pub fn cast_initialized<M: Module>(module: M, dtype: FloatDType) -> M {
    module.map(&mut Cast {
        dtype,
        lazy_too: false,
    })
}

struct Cast {
    dtype: FloatDType,
    /// Whether a lazy parameter is initialised to be cast, or left lazy.
    lazy_too: bool,
}

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.lazy_too && !param.is_initialized() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let (autodiff, require_grad) = (tensor.is_autodiff(), tensor.is_require_grad());
        let device = tensor.device();
        let plain = tensor.inner().cast(self.dtype);
        let tensor = match (autodiff, require_grad) {
            (false, _) => plain,
            (true, false) => autodiff_on(plain, &device),
            (true, true) => autodiff_on(plain, &device).require_grad(),
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// `module` whose not-yet-initialised parameters will be created in `dtype`: each is cast
/// as its initialiser runs, one parameter at a time, so no full-precision copy of the model
/// ever exists (the `init_module` of Fabric). Parameters already initialised are cast now.
pub fn init_in<M: Module>(module: M, dtype: FloatDType) -> M {
    init_in_later(module, Arc::new(OnceLock::from(dtype)))
}

/// [`init_in`] a dtype chosen after `module` is built (`--strategy auto` on a device settles
/// the precision once its ranks have planned): each lazy parameter is cast, as its
/// initialiser runs, to the dtype `dtype` holds by then, and left as initialised where it
/// holds none. Parameters already initialised are cast now if `dtype` is set, else left as
/// they are ([`cast_initialized`] casts them once the dtype is known).
pub fn init_in_later<M: Module>(module: M, dtype: Arc<OnceLock<FloatDType>>) -> M {
    struct InitIn(Arc<OnceLock<FloatDType>>);
    impl ModuleMapper for InitIn {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            // Cast as a leaf that still requires its gradient: Burn's `init_mapper` maps an
            // initialised (loaded) parameter's tracked value, which makes it an operation's
            // output, never stepped.
            if param.is_initialized() {
                return match self.0.get() {
                    Some(&dtype) => Cast {
                        dtype,
                        lazy_too: false,
                    }
                    .map_float(param),
                    None => param,
                };
            }
            let dtype = self.0.clone();
            param.init_mapper(move |t| match dtype.get() {
                Some(&dtype) => t.cast(dtype),
                None => t,
            })
        }
    }
    module.map(&mut InitIn(dtype))
}

/// The distinct dtypes of `module`'s float parameters.
pub fn param_dtypes<M: Module>(module: &M) -> Vec<DType> {
    struct Dtypes(Vec<DType>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let dtype = param.val().dtype();
            if !self.0.contains(&dtype) {
                self.0.push(dtype);
            }
        }
    }
    let mut visit = Dtypes(Vec::new());
    module.visit(&mut visit);
    visit.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    #[test]
    fn cast_keeps_ids_and_gradients_arrive_in_the_new_dtype() {
        let device = Device::default().autodiff();
        let linear: Linear = LinearConfig::new(4, 3).init(&device);
        let id = linear.weight.id;
        let half = cast(linear, FloatDType::BF16);
        assert_eq!(half.weight.id, id);
        assert_eq!(param_dtypes(&half), vec![DType::BF16]);
        let x = Tensor::<2>::ones([2, 4], &device).cast(FloatDType::BF16);
        let grads = half.forward(x).sum().backward();
        let grad = half
            .weight
            .val()
            .grad(&grads)
            .expect("a leaf that requires grad");
        assert_eq!(grad.dtype(), DType::BF16);
    }

    /// A loaded (initialised) parameter given to `init_in` stays a leaf that requires its
    /// gradient, as `cast` keeps it: `--weights` with `--init-on-device` trained nothing.
    #[test]
    fn init_in_keeps_loaded_parameters_trainable() {
        let device = Device::default().autodiff();
        let linear: Linear = LinearConfig::new(4, 3).init(&device);
        let _ = linear.weight.val();
        let half = init_in(linear, FloatDType::BF16);
        assert_eq!(param_dtypes(&half), vec![DType::BF16]);
        let x = Tensor::<2>::ones([2, 4], &device).cast(FloatDType::BF16);
        let grads = half.forward(x).sum().backward();
        let grad = half.weight.val().grad(&grads);
        assert_eq!(grad.map(|g| g.dtype()), Some(DType::BF16));
    }

    /// The dtype is read as each parameter initialises: set after the model was built, it is
    /// the one the parameters are created in; never set, they keep their initialiser's.
    #[test]
    fn init_in_later_creates_parameters_in_the_dtype_set_by_then() {
        let device = Device::default();
        let chosen = Arc::new(OnceLock::new());
        let linear: Linear = init_in_later(LinearConfig::new(4, 3).init(&device), chosen.clone());
        assert!(
            !linear.weight.is_initialized(),
            "init_in_later must stay lazy"
        );
        chosen.set(FloatDType::BF16).unwrap();
        assert_eq!(param_dtypes(&linear), vec![DType::BF16]);
        let loaded: Linear = LinearConfig::new(4, 3).with_bias(false).init(&device);
        let _ = loaded.weight.val();
        let loaded = init_in_later(loaded, Arc::new(OnceLock::new()));
        assert_eq!(
            param_dtypes(&loaded),
            vec![DType::F32],
            "initialised: left as it is"
        );
        assert_eq!(
            param_dtypes(&cast_initialized(loaded, FloatDType::BF16)),
            vec![DType::BF16]
        );
        let lazy = cast_initialized(LinearConfig::new(4, 3).init(&device), FloatDType::F16);
        assert!(
            !lazy.weight.is_initialized(),
            "cast_initialized leaves lazy ones lazy"
        );
        let unset: Linear = init_in_later(
            LinearConfig::new(4, 3).init(&device),
            Arc::new(OnceLock::new()),
        );
        assert_eq!(param_dtypes(&unset), vec![DType::F32]);
    }

    #[test]
    fn init_in_creates_parameters_in_the_dtype() {
        let device = Device::default();
        let linear: Linear = LinearConfig::new(4, 3).init(&device);
        assert!(!linear.weight.is_initialized());
        let linear = init_in(linear, FloatDType::F16);
        assert!(!linear.weight.is_initialized(), "init_in must stay lazy");
        assert_eq!(param_dtypes(&linear), vec![DType::F16]);
    }
}
