//! The fp16 loss scaler's state over a run (Megatron's `DynamicGradScaler`, or a constant
//! scale). The plan carries its settings ([`megac_ir::spec::LossScaler`]); the executor
//! multiplies the loss gradient by [`Scaler::scale`], divides the gradient norm and the
//! gradients by it, and skips the AdamW update of a step whose norm is not finite.

use megac_ir::spec::LossScaler;

/// The scaler's state between steps, as a checkpoint records it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    /// The scale of the next step.
    pub scale: f64,
    /// Clean steps since the last overflow or growth.
    pub growth_tracker: u64,
    /// Overflows left before the scale halves.
    pub hysteresis_tracker: u64,
}

/// The scale and its trackers.
#[derive(Clone, Debug, PartialEq)]
pub struct Scaler {
    cfg: LossScaler,
    scale: f64,
    growth_tracker: u64,
    hysteresis_tracker: u64,
}

impl Scaler {
    /// The state before the first step.
    pub fn new(cfg: LossScaler) -> Scaler {
        Scaler {
            cfg,
            scale: cfg.initial_scale,
            growth_tracker: 0,
            hysteresis_tracker: cfg.hysteresis,
        }
    }

    /// The scale of the next step.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The state a checkpoint keeps: the scale and both trackers.
    pub fn state(&self) -> ScalerState {
        ScalerState {
            scale: self.scale,
            growth_tracker: self.growth_tracker,
            hysteresis_tracker: self.hysteresis_tracker,
        }
    }

    /// Continue from a checkpoint's state (the settings stay the plan's).
    pub fn restore(&mut self, state: &ScalerState) {
        self.scale = state.scale;
        self.growth_tracker = state.growth_tracker;
        self.hysteresis_tracker = state.hysteresis_tracker;
    }

    /// Account for a finished step whose gradients did (`overflow`) or did not overflow,
    /// exactly as Megatron's `DynamicGradScaler.update`: an overflow resets the growth count
    /// and, once the hysteresis count reaches zero, halves the scale (not below the minimum);
    /// `window` clean steps in a row double it and restore the hysteresis count.
    pub fn update(&mut self, overflow: bool) {
        if self.cfg.fixed {
            return;
        }
        if overflow {
            self.growth_tracker = 0;
            self.hysteresis_tracker = self.hysteresis_tracker.saturating_sub(1);
            if self.hysteresis_tracker == 0 {
                self.scale = (self.scale * 0.5).max(self.cfg.min_scale);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.cfg.window {
                self.growth_tracker = 0;
                self.hysteresis_tracker = self.cfg.hysteresis;
                self.scale *= 2.0;
            }
        }
    }
}

/// A scale for people: `2^32` for a power of two, else the number.
pub fn fmt_scale(scale: f64) -> String {
    let k = scale.log2();
    if scale > 0.0 && k.fract() == 0.0 && k.abs() < 1100.0 {
        format!("2^{k}")
    } else {
        format!("{scale}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn scales_print_as_powers_of_two() {
        assert_eq!(super::fmt_scale(4294967296.0), "2^32");
        assert_eq!(super::fmt_scale(1.0), "2^0");
        assert_eq!(super::fmt_scale(1000.0), "1000");
    }

    use super::*;

    fn megatron() -> LossScaler {
        LossScaler {
            initial_scale: 2f64.powi(32),
            min_scale: 1.0,
            window: 1000,
            hysteresis: 2,
            fixed: false,
        }
    }

    #[test]
    fn hysteresis_delays_the_first_halving_then_every_overflow_halves() {
        let mut s = Scaler::new(megatron());
        s.update(true);
        assert_eq!(
            s.scale(),
            2f64.powi(32),
            "the first overflow only uses up hysteresis"
        );
        s.update(true);
        assert_eq!(s.scale(), 2f64.powi(31));
        s.update(true);
        assert_eq!(
            s.scale(),
            2f64.powi(30),
            "the tracker stays at zero until a growth"
        );
        // A clean step in between does not restore the hysteresis.
        s.update(false);
        s.update(true);
        assert_eq!(s.scale(), 2f64.powi(29));
    }

    #[test]
    fn window_clean_steps_double_the_scale_and_restore_hysteresis() {
        let mut s = Scaler::new(LossScaler {
            window: 3,
            ..megatron()
        });
        s.update(true);
        s.update(true);
        assert_eq!(s.scale(), 2f64.powi(31));
        for _ in 0..2 {
            s.update(false);
        }
        assert_eq!(s.scale(), 2f64.powi(31));
        s.update(false);
        assert_eq!(s.scale(), 2f64.powi(32));
        s.update(true);
        assert_eq!(s.scale(), 2f64.powi(32), "hysteresis is back to 2");
        // An overflow resets the growth count.
        s.update(false);
        s.update(false);
        s.update(true);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 2f64.powi(31));
    }

    #[test]
    fn the_scale_never_drops_below_the_minimum_and_a_fixed_scale_never_moves() {
        let mut s = Scaler::new(LossScaler {
            initial_scale: 4.0,
            min_scale: 2.0,
            hysteresis: 1,
            ..megatron()
        });
        for _ in 0..5 {
            s.update(true);
        }
        assert_eq!(s.scale(), 2.0);
        let mut f = Scaler::new(LossScaler {
            initial_scale: 128.0,
            min_scale: 128.0,
            window: 1,
            hysteresis: 1,
            fixed: true,
        });
        f.update(true);
        f.update(false);
        assert_eq!(f.scale(), 128.0);
    }
}
